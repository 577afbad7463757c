"""Ablation benchmark: one drafter family trained once per setting on the same data, acceptance and calibration.

Each variant is a set of recipe overrides. Every variant trains on the same data as `benchmarks.scaling`
(its corpus, one of its nested sizes, its capture store, the same step budget and warm-up rule) and is evaluated
greedily on the held-out prompts. For DSpark it reports the ECE and AUROC of the raw confidence head's
survival product on those prompts (from the evaluation's per-round records); `--calibrate` also runs the
recipe's calibration pass (on the built-in suites' prompts) and the dynamic pass, for the ECE after
temperature scaling (about 2.3 times the decoding).
`reference` is the recipe unchanged; when the scaling run trained and evaluated that family with the same
settings, its training and evaluation folders are copied (same keys, so neither is computed again).

Presets (`--family`):

- `dspark`: DSpark's three reference switches (`drafter.partial_blocks`, `drafter.target_vocab`,
  `drafter.init_std`, all defaulting to DeepSpec's choices), each set to the earlier choice alone, and
  `earlier`, all three at once (DSpark as it was before the switches);
- `eagle3`: regularisers against the one-layer drafter's over-fitting: AdamW weight decay, a frozen output
  head, a narrower MLP and a lower learning rate.

`--variant NAME:KEY=VALUE,KEY=VALUE` adds a variant (values are YAML). Reported per variant: acc_len,
expected accepted tokens per round, per-position acceptance, ECE of the confidence survival product before
and (with `--calibrate`) after temperature scaling and AUROC (DSpark), train seconds. Every stage is cached under
`--run-root/n<N>/<family>-<variant>/`; a rerun prints the saved figures.
Usage: `python -m benchmarks.ablation [--family dspark] [--size 400] [--steps 100] [--only reference,earlier]`.
"""

import argparse
import json
import logging
import re
import shutil
import sys
from pathlib import Path

import torch
import yaml

from benchmarks import scaling
from benchmarks.helpers import scaling_fit as fit
from draftsmith.core import storage
from draftsmith.core.config import PipelineConfig, load_recipe, record_recipe
from draftsmith.core.manifest import StageManifest
from draftsmith.drafters import confidence as cal
from draftsmith.tasks.evaluate import evaluate, read_results
from draftsmith.tasks.hidden_states import capture_hidden_states
from draftsmith.tasks.tokenization import tokenize
from draftsmith.tasks.train import train

PRESETS: dict[str, dict[str, dict]] = {
    "dspark": {
        "reference": {},
        "no-partial-blocks": {"drafter.partial_blocks": False},
        "draft-vocab-target": {"drafter.target_vocab": "draft"},
        "torch-init": {"drafter.init_std": None},
        "earlier": {"drafter.partial_blocks": False, "drafter.target_vocab": "draft", "drafter.init_std": None},
    },
    "eagle3": {
        "reference": {},
        "weight-decay": {"train.weight_decay": 0.1},
        "frozen-head": {"drafter.freeze_lm_head": True},
        "narrow-mlp": {"drafter.intermediate_size": 768},
        "lower-lr": {"train.lr": 0.001},
    },
}

log = logging.getLogger("ablation")


def variant_config(args: argparse.Namespace, overrides: dict) -> PipelineConfig:
    """The family's recipe as the scaling benchmark loads it (calibration pass kept), with `overrides`."""
    path = args.recipe_template.format(kind=args.family)
    base = {k: yaml.safe_load(v) for k, _, v in (s.partition("=") for s in args.set)}
    num_eval = load_recipe(path, base).select.num_eval
    return load_recipe(
        path,
        {
            "select.num_prompts": max(scaling.parse_sizes(args.scaling_sizes)) + num_eval,
            **({"train.epochs": args.epochs} if args.epochs is not None else {}),
            "evaluate.suites": [],
            "evaluate.held_out": True,
            "evaluate.batch_size": args.eval_batch,
            **({} if args.calibrate else {"evaluate.calibration_prompts": 0}),
        }
        | base
        | overrides,
    )


def store_folder(args: argparse.Namespace, c: PipelineConfig, run: str) -> str:
    """The capture folder the scaling run made for these taps: it is named after the first family (in the
    scaling run's order) whose recipe has them, so the first such folder that exists is the one; taps no
    recipe has are captured into a folder named after them."""
    same = []
    for kind in scaling.KINDS:
        path = Path(args.recipe_template.format(kind=kind))
        if path.exists() and load_recipe(str(path)).hidden_states == c.hidden_states:
            same.append(storage.join(run, f"hidden_states-{kind}"))
    made = [uri for uri in same if storage.exists(storage.join(uri, "manifest.json"))]
    # Taps no recipe has get a folder of their own: a family's folder holds its recipe's taps.
    taps = "-".join(map(str, c.hidden_states.taps))
    return (made or same or [storage.join(run, f"hidden_states-taps-{taps}")])[0]


def run_variant(name: str, overrides: dict, up: dict, args: argparse.Namespace) -> dict:
    c = variant_config(args, overrides)
    run = storage.join(args.run_root, f"n{args.size}")
    convs = scaling.subset(up["regenerate"], args.size, f"{run}/regenerate")
    tokens = tokenize(c.tokenize, c.target, convs, out_uri=f"{run}/tokenize")
    store = store_folder(args, c, run)
    hidden = capture_hidden_states(c.hidden_states, c.target, tokens, out_uri=store)
    c = scaling.budget(c, tokens, args)
    fam = storage.join(run, f"{args.family}-{name}")
    record_recipe(c, fam)
    if name == "reference":
        for stage in ("train", "evaluate"):
            reuse_stage(storage.join(run, args.family, stage), f"{fam}/{stage}")
    ckpt = train(c.train, c.drafter, c.target, c.hidden_states, tokens, hidden, seed=c.seed, out_uri=f"{fam}/train")
    ev = evaluate(c.evaluate, c.drafter, c.target, up["select_prompts"], ckpt, out_uri=f"{fam}/evaluate")
    res = read_results(ev)
    conf = res.get("confidence") or {}
    raw = raw_confidence(ev)
    return {
        "variant": name,
        "overrides": overrides,
        "supervised_tokens": tokens.counts["loss_tokens"],
        "steps": ckpt.counts.get("steps"),
        "train_seconds": round(ckpt.seconds, 1),
        "acc_len": res["acc_len"]["overall"],
        "expected_accepted": round(fit.bench_expectations(res["benches"]), 4),
        "position_accept": res["benches"][0]["position_accept"],
        "ece_before": conf.get("ece_before", raw.get("ece")),
        "ece_after": conf.get("ece_after"),
        "auroc_before": conf.get("auroc_before", raw.get("auroc")),
        "mismatched_outputs": res["mismatched_outputs"],
    }


def raw_confidence(ev: StageManifest) -> dict:
    """The raw confidence head's survival ECE and AUROC over the evaluation's rounds (its `prompts.jsonl`
    holds each round's confidence logits and accepted count); `{}` for a drafter without confidences."""
    rows = [json.loads(line) for line in storage.read_bytes(ev.path("prompts.jsonl")).decode().splitlines() if line]
    records = [cal.ConfidenceRecord(torch.tensor(c), n) for r in rows for c, n in r.get("confidence") or []]
    if not records:
        return {}
    m = cal.confidence_metrics(records)
    return {"ece": m["ece"], "auroc": m["auroc"]}


def reuse_stage(src: str, dst: str) -> None:
    """Copy the scaling run's stage folder of the family (a local run root only); the stage then checks its key
    and every file's digest as for any cached result, and computes afresh when they do not match."""
    if "://" in src or not Path(src, "manifest.json").exists() or Path(dst).exists():
        return
    shutil.copytree(src, dst)


def _num(x: float | None) -> float:
    return float("nan") if x is None else x


def table(rows: list[dict]) -> str:
    head = (
        f"{'variant':<20}{'acc_len':>9}{'E[acc]/rnd':>11}{'ECE before':>12}{'ECE after':>11}{'AUROC':>8}{'train s':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        ece_b, ece_a, auc = (_num(r[k]) for k in ("ece_before", "ece_after", "auroc_before"))
        lines.append(
            f"{r['variant']:<20}{r['acc_len']:>9.3f}{r['expected_accepted']:>11.3f}{ece_b:>12.4f}{ece_a:>11.4f}"
            f"{auc:>8.3f}{r['train_seconds']:>9.0f}"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default="dspark", choices=sorted(PRESETS), help="drafter family and its preset")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE,...", help="another variant")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="as the scaling run's --set")
    p.add_argument("--size", type=int, default=400, help="training prompts (a nested size of the scaling corpus)")
    p.add_argument("--scaling-sizes", default="40,128,400", help="the scaling run's --sizes (its corpus size)")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps (epochs follow), as in the scaling run")
    p.add_argument("--epochs", type=int, default=None, help="instead of --steps: train.epochs")
    p.add_argument("--only", default=None, help="comma-separated variants (default: all)")
    p.add_argument("--recipe-template", default=scaling.RECIPE_TEMPLATE, help="recipe path with {kind}")
    p.add_argument("--warmup-cap", type=float, default=0.1, help="warm-up at most this share of the steps")
    p.add_argument(
        "--calibrate", action="store_true", help="DSpark: also the calibration and dynamic passes (ECE after)"
    )
    p.add_argument("--eval-batch", type=int, default=8, help="held-out prompts decoded together")
    p.add_argument("--run-root", default="runs/scaling")
    p.add_argument("--json", default=None, help="default: <run-root>/ablation-<family>.json")
    args = p.parse_args(argv)
    if args.epochs is not None:
        args.steps = None
    return args


def usage_error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def variants(args: argparse.Namespace) -> dict[str, dict]:
    out = dict(PRESETS[args.family])
    for text in args.variant:
        name, sep, body = text.partition(":")
        if not sep or not name:
            usage_error(f"--variant: NAME:KEY=VALUE,... expected, got {text!r}")
        # A comma inside [...] or {...} belongs to a YAML value (a list of taps), not between pairs.
        pairs = [kv.partition("=") for kv in re.split(r",(?![^\[{]*[\]}])", body) if kv]
        bad = next((k for k, eq, _ in pairs if not eq), None)
        if bad is not None:
            usage_error(f"--variant {name}: KEY=VALUE expected, got {bad!r}")
        out[name] = {k: yaml.safe_load(v) for k, _, v in pairs}
    names = args.only.split(",") if args.only else list(out)
    unknown = [n for n in names if n not in out]
    if unknown:
        usage_error(f"--only: unknown variant {unknown[0]!r}; known: {', '.join(out)}")
    return {n: out[n] for n in names}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.json = args.json or f"{args.run_root}/ablation-{args.family}.json"
    # force: importing prefect installs its own root handler at WARNING, which would hide this progress
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", force=True)
    chosen = variants(args)
    for overrides in chosen.values():
        variant_config(args, overrides)  # every variant's recipe validates before anything runs
    up = scaling.corpus(variant_config(args, {}), args.run_root)
    rows = []
    for name, overrides in chosen.items():
        rows.append(run_variant(name, overrides, up, args))
        log.info("%s: acc_len %.3f", name, rows[-1]["acc_len"])
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        report = {"family": args.family, "size": args.size, "steps": args.steps, "epochs": args.epochs, "rows": rows}
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print("\n" + table(rows))
    print(f"json: {args.json}")


if __name__ == "__main__":
    main()
