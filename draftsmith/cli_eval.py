"""`draftsmith eval` and `draftsmith sweep`: judge any drafter checkpoint on benchmarks, or a served one on
throughput against concurrency."""

import argparse
import hashlib
import json
import sys
from pathlib import Path

from draftsmith.core.config import PipelineConfig, load_recipe


def _recipe_for(checkpoint: str, recipe: str | None) -> PipelineConfig:
    """The recipe named, or the run's `recipe.yaml` above a train stage or an export folder."""
    if recipe:
        return load_recipe(recipe)
    for parent in Path(checkpoint).resolve().parents[:3]:
        if (parent / "recipe.yaml").exists():
            return load_recipe(parent / "recipe.yaml")
    raise SystemExit(f"eval: no recipe.yaml above {checkpoint}; pass --recipe (it names the target and drafter)")


def add_parsers(sub) -> None:
    p = sub.add_parser("eval", help="evaluate a drafter checkpoint on benchmarks (acceptance, throughput)")
    p.add_argument("checkpoint", help="a run's train/ folder or an export folder (vLLM format)")
    p.add_argument("--recipe", help="recipe naming target and drafter (default: the run's recipe.yaml)")
    p.add_argument("--bench", action="append", default=[], metavar="NAME=PATH", help="benchmark file (repeatable)")
    p.add_argument("--suites", default="all", help="built-in suites: all, none, or a comma list of categories")
    p.add_argument("--prompts-per-suite", type=int, help="prompts per built-in suite")
    p.add_argument("--temperature", type=float, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, help="nucleus mass")
    p.add_argument("--rule", choices=["greedy", "token", "block"], help="verification rule")
    p.add_argument("--max-new-tokens", type=int, help="tokens per turn")
    p.add_argument("--out", help="results folder (default: <checkpoint>/../eval-<hash of the settings>)")
    p = sub.add_parser("sweep", help="serving throughput against concurrency with vLLM, speculation on and off")
    p.add_argument("draft", help="an exported vLLM draft folder (`draftsmith export RUN --engine vllm`)")
    p.add_argument("--recipe", help="recipe naming the target (default: the run's recipe.yaml)")
    p.add_argument("--concurrency", default="1,2,4,8,16,32,64", help="comma list of levels")
    p.add_argument("--requests", type=int, default=128, help="requests per level")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    p.add_argument("--num-speculative-tokens", type=int, help="drafts per round (EAGLE-3: evaluate.num_draft_tokens)")
    p.add_argument("--out", help="folder for sweep.json and the plot (default: <draft>/sweep)")


def cmd_eval(args: argparse.Namespace) -> int:
    from draftsmith.core.stage import IntegrityError
    from draftsmith.evals.loaders import parse_bench_arg
    from draftsmith.tasks.evaluate import evaluate_checkpoint, format_table

    cfg = _recipe_for(args.checkpoint, args.recipe)
    ev = cfg.evaluate.model_dump()
    suites = {"all": ["all"], "none": []}.get(args.suites, [s.strip() for s in args.suites.split(",") if s.strip()])
    ev |= {"suites": suites, "held_out": False, "bench_files": dict(parse_bench_arg(b) for b in args.bench)}
    for field in ("prompts_per_suite", "temperature", "top_p", "max_new_tokens"):
        if getattr(args, field) is not None:
            ev[field] = getattr(args, field)
    if args.rule:
        ev["verification"] = args.rule
    elif ev["temperature"] > 0 and ev["verification"] == "greedy":
        ev["verification"] = "token"
    ev_cfg = type(cfg.evaluate).model_validate(ev)
    digest = hashlib.sha256(json.dumps([args.checkpoint, ev_cfg.model_dump(mode="json")], sort_keys=True).encode())
    out = args.out or str(Path(args.checkpoint).resolve().parent / f"eval-{digest.hexdigest()[:12]}")
    Path(out).mkdir(parents=True, exist_ok=True)
    try:
        results, _ = evaluate_checkpoint(
            ev_cfg, cfg.drafter, cfg.target, None, args.checkpoint, seed=cfg.seed, uri=out, key=digest.hexdigest()
        )
    except IntegrityError as err:  # a checkpoint that is not what training recorded: say which file, no traceback
        print(f"eval failed: {err}", file=sys.stderr)
        return 1
    print(format_table(results))
    print(f"results: {out}/results.json")
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from draftsmith.core.target_setup import resolve_target
    from draftsmith.evals import plots
    from draftsmith.evals.sweep import SweepConfig, sweep_server

    cfg = _recipe_for(args.draft, args.recipe)
    levels = tuple(int(c) for c in args.concurrency.split(","))
    sweep_cfg = SweepConfig(
        concurrency=levels, requests_per_level=max(args.requests, max(levels)), max_tokens=args.max_tokens
    )
    target_dir = str(resolve_target(cfg.target.source))
    out = Path(args.out or Path(args.draft) / "sweep")
    out.mkdir(parents=True, exist_ok=True)
    chain = cfg.drafter.serving_tokens(cfg.evaluate.num_draft_tokens)
    runs = []
    for draft in (args.draft, None):
        run = sweep_server(target_dir, draft, sweep_cfg, num_speculative_tokens=args.num_speculative_tokens or chain)
        runs.append(run | {"drafter": cfg.drafter.kind})
    (out / "sweep.json").write_text(json.dumps(runs, indent=2) + "\n")
    plots.throughput_vs_concurrency(runs, out / "throughput_vs_concurrency.png")
    for run in runs:
        tps = ", ".join(f"{lv['concurrency']}: {lv['output_tokens_per_s']:.1f}" for lv in run["levels"])
        print(f"speculative={run['speculative']}: output tokens/s by concurrency {tps}")
    print(f"sweep: {out}/sweep.json")
    return 0
