"""Scaling benchmark: EAGLE-3, DFlash2 and DSpark acceptance against the amount of training data.

One corpus is selected and regenerated once (the largest size plus the held-out prompts). Each smaller
training set is a nested subset of it: the regenerated conversations are ordered by a stable hash of their
id and the first N kept, so every smaller set lies inside every larger one. For each size every family
tokenizes, captures (a store shared by families whose `hidden_states` sections agree), trains over the same
samples with the same `train` section and the same budget, and is evaluated greedily on the held-out prompts
with real speculative decoding against the target. The budget is about `--steps` optimizer steps at every
size (the epochs follow from the size's tokens), so a larger set means more distinct data, not more updates;
`--epochs` fixes the epochs instead.

Reported per size and family: supervised (loss) tokens, acc_len, the expected accepted tokens per round from
the per-position acceptance (all drafts, and the first `--depth` drafts, for a like-for-like look at
drafters with different draft counts), the training slot accuracy simulation, and train seconds. Per family a
least-squares line acc_len = a + b·log2(tokens) gives the gain per doubling of data; for every pair the table
says where the measured curves change order and where the fitted lines meet.

Every stage is cached under `--run-root` (`corpus/` and `n<N>/`), so a rerun only redoes what changed.
Usage: `python -m benchmarks.scaling [--sizes 40,128,400] [--steps 100 | --epochs 3] [--families eagle3,dspark]`.
"""

import argparse
import hashlib
import json
import logging
import math
import sys
from pathlib import Path

import yaml

from benchmarks.helpers import data_stages
from benchmarks.helpers import scaling_fit as fit
from draftsmith.core import storage
from draftsmith.core.config import PipelineConfig, load_recipe, record_recipe
from draftsmith.core.manifest import StageManifest, file_entry
from draftsmith.core.stage import StageResult, run_stage, stage_key
from draftsmith.tasks.evaluate import evaluate, read_results
from draftsmith.tasks.hidden_states import capture_hidden_states
from draftsmith.tasks.regenerate import read_conversations
from draftsmith.tasks.tokenization import tokenize
from draftsmith.tasks.train import train

ROOT = Path(__file__).resolve().parents[1]
RECIPE_TEMPLATE = str(ROOT / "deployments" / "recipes" / "smollm2-cpu-{kind}.yaml")
KINDS = ["eagle3", "dflash2", "dspark"]
UPSTREAM = ["target", "select", "regenerate", "tokenize", "seed"]

log = logging.getLogger("scaling")


def load_configs(args: argparse.Namespace) -> dict[str, PipelineConfig]:
    """Each family's recipe with the benchmark's overrides: enough prompts for the largest size, `--epochs`
    when given (else each size's epochs follow from `--steps`), held-out prompts only (no built-in suites, no
    DSpark calibration pass) and the `--set` values."""
    sizes = parse_sizes(args.sizes)
    base = {k: yaml.safe_load(v) for k, _, v in (s.partition("=") for s in args.set)}
    cfgs = {}
    for kind in args.families.split(","):
        path = args.recipe_template.format(kind=kind)
        num_eval = load_recipe(path, base).select.num_eval
        overrides = {
            "select.num_prompts": max(sizes) + num_eval,
            **({"train.epochs": args.epochs} if args.epochs is not None else {}),
            "evaluate.suites": [],
            "evaluate.held_out": True,
            "evaluate.calibration_prompts": 0,
            "evaluate.batch_size": args.eval_batch,
        } | base
        cfgs[kind] = load_recipe(path, overrides)
    first = next(iter(cfgs.values()))
    for kind, c in cfgs.items():
        for section in UPSTREAM:
            if getattr(c, section) != getattr(first, section):
                raise SystemExit(f"{kind}: recipe section {section!r} differs from {first.name}; not the same data")
    return cfgs


def parse_sizes(text: str) -> list[int]:
    sizes = sorted({int(s) for s in text.split(",") if s.strip()})
    if not sizes or sizes[0] < 1:
        raise SystemExit(f"--sizes: positive prompt counts expected, got {text!r}")
    return sizes


def corpus(c: PipelineConfig, root: str) -> dict[str, StageManifest]:
    """select → regenerate once, for the largest size, under `<root>/corpus/`."""
    return data_stages.run_data_stages(c, storage.join(root, "corpus"), last="regenerate")


def _rank(row_id: str) -> str:
    """Stable order of conversations: nested subsets whatever the engine's output order."""
    return hashlib.sha256(row_id.encode()).hexdigest()


def subset(conversations: StageManifest, n: int, out_uri: str) -> StageManifest:
    """A regenerate-stage folder holding the first `n` conversations by `_rank` (all when fewer exist),
    with the parent's provenance, so the tokenize stage reads it like the real one."""
    key = stage_key("regenerate-subset", [sys.modules[__name__]], parent=conversations, n=n)

    def compute(uri: str) -> StageResult:
        rows = sorted(read_conversations(conversations), key=lambda r: _rank(r["id"]))[:n]
        data = "".join(json.dumps(r) + "\n" for r in rows).encode()
        files = [file_entry(uri, "conversations-00000.jsonl", data)]
        if "provenance.json" in conversations.names():
            files.append(file_entry(uri, "provenance.json", storage.read_bytes(conversations.path("provenance.json"))))
        return StageResult(files=files, counts={"conversations": len(rows)}, info=dict(conversations.info))

    return run_stage("regenerate", out_uri, key, compute)


def epochs_for(c: PipelineConfig, tokens: StageManifest, steps: int | None) -> int:
    """`train.epochs` for about `steps` optimizer steps over this size's tokens (the recipe's with `steps`
    None). A fixed step budget keeps a small set from being compared after a handful of updates: at 3 epochs
    and 1024-token batches, 64 prompts train 12 steps and no family learns anything."""
    t = c.train
    if steps is None:
        return t.epochs
    return max(1, round(steps * t.batch_tokens * t.grad_accum / tokens.counts["tokens"]))


def budget(c: PipelineConfig, tokens: StageManifest, args: argparse.Namespace) -> PipelineConfig:
    """`c` with this size's epochs (`--steps`) and the warm-up cut to `--warmup-cap` of its steps."""
    c = c.model_copy(update={"train": c.train.model_copy(update={"epochs": epochs_for(c, tokens, args.steps)})})
    warm = warmup_for(c, tokens, args.warmup_cap)
    return c.model_copy(update={"train": c.train.model_copy(update={"warmup_steps": warm})})


def warmup_for(c: PipelineConfig, tokens: StageManifest, cap: float) -> int:
    """The recipe's warm-up, shortened to at most `cap` of the planned steps: a small set trains only a few
    steps, and a warm-up longer than the run would never reach the peak learning rate."""
    t = c.train
    steps = math.ceil(t.epochs * tokens.counts["tokens"] / (t.batch_tokens * t.grad_accum))
    return max(1, min(t.warmup_steps, int(cap * steps)))


def run_size(cfgs: dict[str, PipelineConfig], up: dict, n: int, args: argparse.Namespace) -> list[dict]:
    """Tokenize, capture, train and evaluate every family on the first `n` conversations."""
    first = next(iter(cfgs.values()))
    run = storage.join(args.run_root, f"n{n}")
    convs = subset(up["regenerate"], n, f"{run}/regenerate")
    tokens = tokenize(first.tokenize, first.target, convs, out_uri=f"{run}/tokenize")
    rows = []
    for kind, c in cfgs.items():
        owner = next(k for k, o in cfgs.items() if o.hidden_states == c.hidden_states)
        hidden = capture_hidden_states(c.hidden_states, c.target, tokens, out_uri=f"{run}/hidden_states-{owner}")
        c = budget(c, tokens, args)
        fam = storage.join(run, kind)
        record_recipe(c, fam)  # `draftsmith export <run>` reads it
        ckpt = train(c.train, c.drafter, c.target, c.hidden_states, tokens, hidden, seed=c.seed, out_uri=f"{fam}/train")
        ev = evaluate(c.evaluate, c.drafter, c.target, up["select_prompts"], ckpt, out_uri=f"{fam}/evaluate")
        rows.append(row_of(kind, n, tokens, ckpt, read_results(ev), args.depth, c.train))
        log.info("n=%d %s: acc_len %.3f", n, kind, rows[-1]["acc_len"])
    return rows


def row_of(kind: str, n: int, tokens: StageManifest, ckpt: StageManifest, res: dict, depth: int, t) -> dict:
    benches = res["benches"]
    return {
        "family": kind,
        "prompts": n,
        "samples": tokens.counts["samples"],
        "supervised_tokens": tokens.counts["loss_tokens"],
        "tokens": tokens.counts["tokens"],
        "padded_tokens": ckpt.counts.get("padded_tokens"),
        "steps": ckpt.counts.get("steps"),
        "epochs": t.epochs,
        "warmup_steps": t.warmup_steps,
        "train_seconds": round(ckpt.seconds, 1),
        "drafts_per_round": res["draft_tokens_per_round"],
        "acc_len": res["acc_len"]["overall"],
        "expected_accepted": round(fit.bench_expectations(benches), 4),
        f"expected_accepted_first_{depth}": round(fit.bench_expectations(benches, depth), 4),
        "position_accept": benches[0]["position_accept"] if len(benches) == 1 else None,
        "simulated_acc_len": ckpt.metrics.get("simulated_acc_len"),
        "eval_prompts": res["prompts"],
        "mismatched_outputs": res["mismatched_outputs"],
    }


def summarise(rows: list[dict], depth: int) -> dict:
    """Per-family fits of acc_len and of expected accepted/round against log2(tokens), and the crossings."""
    families = list(dict.fromkeys(r["family"] for r in rows))
    sizes = sorted({r["prompts"] for r in rows})
    by = {(r["family"], r["prompts"]): r for r in rows}
    complete = [n for n in sizes if all((f, n) in by for f in families)]
    tokens = [by[(families[0], n)]["supervised_tokens"] for n in complete]
    out: dict = {"sizes": complete, "supervised_tokens": tokens}
    if len(complete) < 2:
        return out
    for metric in ["acc_len", "expected_accepted", f"expected_accepted_first_{depth}"]:
        series = {f: [by[(f, n)][metric] for n in complete] for f in families}
        fits = {f: fit.fit_line(tokens, ys) for f, ys in series.items()}
        out[metric] = {"fits": fits, "crossings": fit.crossings(tokens, series, fits)}
    return out


def table(rows: list[dict], depth: int) -> str:
    head = (
        f"{'prompts':>8}{'sup. tokens':>12}  {'family':<8}{'drafts':>7}{'acc_len':>9}{'E[acc]/rnd':>11}"
        f"{f'E[acc@{depth}]':>10}{'sim acc_len':>12}{'steps':>7}{'train s':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in sorted(rows, key=lambda r: (r["prompts"], KINDS.index(r["family"]) if r["family"] in KINDS else 9)):
        sim = r["simulated_acc_len"]
        lines.append(
            f"{r['prompts']:>8}{r['supervised_tokens']:>12,}  {r['family']:<8}{r['drafts_per_round']:>7}"
            f"{r['acc_len']:>9.3f}{r['expected_accepted']:>11.3f}{r[f'expected_accepted_first_{depth}']:>10.3f}"
            f"{(sim if sim is not None else float('nan')):>12.3f}{r['steps'] or 0:>7}{r['train_seconds']:>9.0f}"
        )
    return "\n".join(lines)


def fits_text(summary: dict) -> str:
    lines = []
    for metric in ["acc_len", "expected_accepted"]:
        if metric not in summary:
            continue
        for fam, f in summary[metric]["fits"].items():
            lines.append(
                f"{metric:<18}{fam:<8} {f['per_doubling']:+.4f} per doubling (rms residual {f['rms_residual']:.3f})"
            )
        for c in summary[metric]["crossings"]:
            meet = c["fitted_meet_tokens"]
            lines.append(
                f"{metric:<18}{' vs '.join(c['pair']):<18} order changes between {c['measured_between'] or '-'}"
                f"; fitted lines meet at {f'{meet:,}' if meet is not None else '-'} tokens; ahead at largest: "
                f"{c['ahead_at_largest']}"
            )
    return "\n".join(lines)


def write(rows: list[dict], args: argparse.Namespace, cfgs: dict[str, PipelineConfig]) -> dict:
    summary = summarise(rows, args.depth)
    report = {
        "families": list(cfgs),
        "epochs": args.epochs,
        "steps": args.steps,
        "recipes": {k: c.name for k, c in cfgs.items()},
        "depth": args.depth,
        "rows": rows,
        "summary": summary,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if "acc_len" in summary:
        Path(args.png).parent.mkdir(parents=True, exist_ok=True)
        fit.plot(rows, summary["acc_len"]["fits"], args.png)
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="40,128,400", help="training prompt counts (nested subsets of one corpus)")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps per size and family (epochs follow)")
    p.add_argument("--epochs", type=int, default=None, help="instead of --steps: train.epochs for every size")
    p.add_argument("--families", default=",".join(KINDS), help="comma-separated drafter kinds")
    p.add_argument("--recipe-template", default=RECIPE_TEMPLATE, help="recipe path with {kind}")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override in all recipes")
    p.add_argument("--depth", type=int, default=3, help="drafts counted in the like-for-like expectation")
    p.add_argument("--warmup-cap", type=float, default=0.1, help="warm-up at most this share of the steps")
    p.add_argument("--eval-batch", type=int, default=8, help="held-out prompts decoded together")
    p.add_argument("--run-root", default="runs/scaling")
    p.add_argument("--json", default="runs/scaling/scaling.json")
    p.add_argument("--png", default="runs/scaling/scaling.png")
    args = p.parse_args(argv)
    if args.epochs is not None:
        args.steps = None
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # force: importing prefect installs its own root handler at WARNING, which would hide this progress
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", force=True)
    cfgs = load_configs(args)
    up = corpus(next(iter(cfgs.values())), args.run_root)
    rows: list[dict] = []
    for n in parse_sizes(args.sizes):  # smallest first: an interrupted run still leaves complete sizes
        rows += run_size(cfgs, up, n, args)
        write(rows, args, cfgs)
    report = write(rows, args, cfgs)
    print("\n" + table(rows, args.depth))
    print(fits_text(report["summary"]))
    print(f"json: {args.json}  png: {args.png}")


if __name__ == "__main__":
    main()
