"""Quality benchmark: EAGLE-3, DFlash2 and DSpark on the embedded default, same data and token budget.

Runs the pipeline's stage functions for `smollm2-cpu-{eagle3,dflash2,dspark}.yaml`. Prompts, responses and
tokens are produced once (the three recipes' upstream sections must be identical, and are checked); a
hidden-state store is shared by recipes whose `hidden_states` sections agree (DFlash2 and DSpark: 5 taps).
Every drafter trains the same epochs over the same samples with the same `train` section, so the padded
training-token count is the same, and is printed to show it. Each is then evaluated greedily on the held-out
prompts with real speculative decoding against the target (outputs must equal plain greedy decoding).

Stages are cached under `runs/<recipe>/<stage>` like `draftsmith run`, so a rerun only redoes what changed.
Usage: `python -m benchmarks.drafters_acc_len [--set train.epochs=2 ...] [--only eagle3,dspark]`.
"""

import argparse
import logging
import time
from pathlib import Path

import yaml

from benchmarks.helpers import data_stages
from draftsmith.core import storage
from draftsmith.core.config import PipelineConfig, load_recipe, record_recipe
from draftsmith.tasks.evaluate import evaluate, read_results
from draftsmith.tasks.hidden_states import capture_hidden_states
from draftsmith.tasks.train import train

RECIPES = Path(__file__).resolve().parents[1] / "deployments" / "recipes"

KINDS = ["eagle3", "dflash2", "dspark"]
# The DSpark paper's Qwen3-4B GSM8K acceptance lengths (block 7, T=1), for scale only.
PAPER = {"eagle3": 5.14, "dflash2": 5.40, "dspark": 6.11}


def _upstream(cfgs: dict[str, PipelineConfig], root: str) -> dict:
    """select → regenerate → tokenize once, in the first recipe's run folder."""
    first = next(iter(cfgs.values()))
    for kind, c in cfgs.items():
        for section in ["target", "select", "regenerate", "tokenize", "seed"]:
            if getattr(c, section) != getattr(first, section):
                raise SystemExit(f"{kind}: recipe section {section!r} differs from {first.name}; not the same data")
    return data_stages.run_data_stages(first, storage.join(root, first.name), last="tokenize")


def _store(c: PipelineConfig, cfgs: dict[str, PipelineConfig], root: str, tokens):
    """The hidden-state store of the first recipe with this `hidden_states` section (shared, not re-captured)."""
    owner = next(o for o in cfgs.values() if o.hidden_states == c.hidden_states)
    uri = storage.join(root, owner.name, "hidden_states")
    return capture_hidden_states(c.hidden_states, c.target, tokens, out_uri=uri)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override in all recipes")
    parser.add_argument("--only", default=",".join(KINDS), help="comma-separated drafter kinds")
    parser.add_argument("--run-root", default="runs")
    args = parser.parse_args()
    # force: importing prefect installs its own root handler at WARNING, which would hide this progress
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", force=True)
    overrides = {k: yaml.safe_load(v) for k, _, v in (s.partition("=") for s in args.set)}
    cfgs = {k: load_recipe(RECIPES / f"smollm2-cpu-{k}.yaml", overrides) for k in args.only.split(",")}
    up = _upstream(cfgs, args.run_root)
    rows = []
    for kind, c in cfgs.items():
        run = storage.join(args.run_root, c.name)
        record_recipe(c, run)  # `draftsmith export <run>` reads it
        hidden = _store(c, cfgs, args.run_root, up["tokenize"])
        t0 = time.perf_counter()
        ckpt = train(
            c.train, c.drafter, c.target, c.hidden_states, up["tokenize"], hidden, seed=c.seed, out_uri=f"{run}/train"
        )
        t1 = time.perf_counter()
        ev = evaluate(c.evaluate, c.drafter, c.target, up["select_prompts"], ckpt, out_uri=f"{run}/evaluate")
        res = read_results(ev)
        rows.append((kind, ckpt, res, t1 - t0))
    print(
        f"\n{'drafter':<9}{'drafts/rnd':>11}{'acc_len':>9}{'tok/s spec':>12}{'speedup':>9}"
        f"{'train tokens':>14}{'steps':>7}{'train s':>9}{'sim acc_len':>12}{'paper':>7}  differ"
    )
    for kind, ckpt, res, seconds in rows:
        print(
            f"{kind:<9}{res['draft_tokens_per_round']:>11}{res['acc_len']['overall']:>9.3f}"
            f"{res['tokens_per_s']['speculative']:>12.2f}{res['speedup']:>9.3f}{ckpt.counts['padded_tokens']:>14,}"
            f"{ckpt.counts['steps']:>7}{seconds:>9.0f}{ckpt.metrics['simulated_acc_len']:>12.3f}{PAPER[kind]:>7.2f}"
            f"  {res['mismatched_outputs']}"
        )
    print(f"held-out prompts: {rows[0][2]['prompts']}; baseline {rows[0][2]['tokens_per_s']['baseline']:.2f} tok/s")


if __name__ == "__main__":
    main()
