"""The acceptance table of the three trained SmolLM2 drafters on the built-in suites, at temperature 0
(greedy verification) and at temperature 1 / top_p 0.95 (token verification), with DSpark's confidence
calibration (ECE before/after) and dynamic verification.

Needs the trained runs `runs/smollm2-cpu-{eagle3,dflash2,dspark}/train` (`python -m benchmarks.drafters_acc_len`
makes them; `make bench` runs it first). Seeds are fixed, so a rerun prints the same table to the digit.
Usage: `python -m benchmarks.eval_table [--prompts-per-suite 4] [--max-new-tokens 64] [--only eagle3,...]`
(defaults: the recipes' evaluate settings, i.e. what the pipeline's evaluate stage measures).
"""

import argparse
import json
import time
from pathlib import Path

from draftsmith.core.config import load_recipe
from draftsmith.evals.report import acceptance_table
from draftsmith.tasks.evaluate import evaluate_checkpoint

RUNS = Path(__file__).resolve().parents[1] / "runs"
KINDS = ("eagle3", "dflash2", "dspark")
SETTINGS = ((0.0, 1.0, "greedy"), (1.0, 0.95, "token"))


def evaluate_run(kind: str, temperature: float, top_p: float, rule: str, args) -> dict:
    run = RUNS / f"smollm2-cpu-{kind}"
    cfg = load_recipe(run / "recipe.yaml")
    ev = cfg.evaluate.model_copy(
        update={
            "temperature": temperature, "top_p": top_p, "verification": rule, "held_out": False,
            "prompts_per_suite": args.prompts_per_suite or cfg.evaluate.prompts_per_suite,
            "max_new_tokens": args.max_new_tokens or cfg.evaluate.max_new_tokens,
        }
    )  # fmt: skip
    out = run / f"eval-table-t{temperature:g}"
    out.mkdir(exist_ok=True)
    results, _ = evaluate_checkpoint(
        ev, cfg.drafter, cfg.target, None, str(run / "train"), seed=cfg.seed, uri=str(out), key=f"table-{kind}"
    )
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts-per-suite", type=int, help="default: the recipe's evaluate.prompts_per_suite")
    parser.add_argument("--max-new-tokens", type=int, help="default: the recipe's evaluate.max_new_tokens")
    parser.add_argument("--only", default=",".join(KINDS))
    args = parser.parse_args(argv)
    kinds = [k for k in args.only.split(",") if k]
    missing = [k for k in kinds if not (RUNS / f"smollm2-cpu-{k}" / "train" / "model.safetensors").exists()]
    if missing:
        raise SystemExit(f"eval_table: no trained run for {missing}; run `python -m benchmarks.drafters_acc_len`")
    rows, confidence = [], []
    for temperature, top_p, rule in SETTINGS:
        for kind in kinds:
            start = time.perf_counter()
            results = evaluate_run(kind, temperature, top_p, rule, args)
            rows += results["benches"] + results.get("dynamic", [])
            if "confidence" in results:
                c = results["confidence"]
                confidence.append((temperature, c["ece_before"], c["ece_after"], c["auroc_before"], c["auroc_after"]))
            print(f"{kind} T={temperature:g}: acc_len {results['acc_len']['overall']:.3f} "
                  f"speed-up {results['speedup']:.3f} ({time.perf_counter() - start:.0f} s)", flush=True)  # fmt: skip
    print("\n".join(acceptance_table(rows)))
    for temperature, before, after, auroc_b, auroc_a in confidence:
        print(
            f"dspark T={temperature:g}: ECE {before:.4f} -> {after:.4f} after calibration; AUROC {auroc_b} -> {auroc_a}"
        )
    print(json.dumps({"rows": len(rows)}))


if __name__ == "__main__":
    main()
