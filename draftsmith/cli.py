"""`draftsmith`: set up the embedded target, plan and run recipes.

Exit codes: 0 success, 1 a stage failed, 2 a bad recipe or bad arguments.
"""

import argparse
import logging
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import yaml

from draftsmith import cli_baseline, cli_deploy, cli_eval
from draftsmith.config import PipelineConfig, RecipeError, load_recipe


def _env_defaults() -> None:
    """Offline, no telemetry, and a Prefect home of the project's own unless the user set one."""
    from draftsmith.target_setup import cache_root

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # per-load bars clutter the stage log
    os.environ.setdefault("PREFECT_HOME", str(cache_root() / "prefect"))


def _overrides(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise RecipeError(f"--set {pair!r}: expected dotted.key=value")
        out[key] = yaml.safe_load(value)
    return out


def _load(args: argparse.Namespace) -> PipelineConfig:
    return load_recipe(args.recipe, _overrides(args.set or []))


def cmd_setup_target(args: argparse.Namespace) -> int:
    from draftsmith.target_setup import ensure_smollm2, ensure_tiny_target

    print(f"embedded target: {ensure_smollm2()}")
    print(f"tiny test target: {ensure_tiny_target()}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from draftsmith.plan import render_plan
    from flows.pipeline import default_run_dir

    cfg = _load(args)
    print(render_plan(cfg, args.run_dir or default_run_dir(cfg)))
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    cfg = _load(args)
    print(f"{args.recipe}: valid recipe {cfg.name!r}")
    return 0


def _stage_table(manifests: dict, started: datetime) -> str:
    lines = [f"{'stage':<16}{'seconds':>9}  status", "-" * 40]
    for name, m in manifests.items():
        fresh = datetime.fromisoformat(m.created_at) >= started
        lines.append(f"{name:<16}{m.seconds:>9.1f}  {'ran' if fresh else 'cached'}")
    return "\n".join(lines)


def cmd_run(args: argparse.Namespace) -> int:
    from flows.pipeline import default_run_dir, kimi_k3
    from tasks.evaluate import format_table, read_results

    cfg = _load(args)
    run_dir = args.run_dir or default_run_dir(cfg)
    started = datetime.now(UTC)
    t0 = time.perf_counter()
    manifests = kimi_k3(config=cfg, run_dir=run_dir)
    print()
    print(_stage_table(manifests, started))
    print(f"total wall time {time.perf_counter() - t0:.1f} s; artifacts under {run_dir}")
    print()
    print(format_table(read_results(manifests["evaluate"])))
    print(f"drafter checkpoint: {manifests['train'].uri}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from drafters.export.bundle import export_run
    from drafters.export.guards import ExportError

    try:
        result = export_run(args.run, args.engine, recipe=args.recipe, out=args.out)
    except ExportError as err:
        print(f"export failed: {err}", file=sys.stderr)
        return 1
    print(result.render())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draftsmith", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("setup-target", help="build the embedded SmolLM2 target and the tiny test target")
    for name, helptext in (
        ("run", "run a recipe end to end"),
        ("plan", "print what a recipe would do"),
        ("validate", "validate a recipe"),
    ):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("recipe", type=Path, help="YAML recipe, e.g. deployments/recipes/smollm2-cpu-eagle3.yaml")
        p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a dotted recipe field")
        if name != "validate":
            p.add_argument("--run-dir", help="run folder or URL (default: <storage.run_root>/<name>)")
    p = sub.add_parser("export", help="export a run's trained drafter for a serving engine")
    p.add_argument("run", help="run folder (holds train/ and hidden_states/)")
    p.add_argument("--engine", required=True, choices=["vllm", "sglang", "tokenspeed"], help="serving engine")
    p.add_argument("--out", help="output folder (default: <run>/export/<engine>)")
    p.add_argument("--recipe", help="the run's recipe (default: <run>/recipe.yaml)")
    cli_eval.add_parsers(sub)
    cli_deploy.add_parsers(sub)
    cli_baseline.add_parsers(sub)
    return parser


COMMANDS = {
    "setup-target": cmd_setup_target,
    "run": cmd_run,
    "plan": cmd_plan,
    "validate": cmd_validate,
    "export": cmd_export,
    "eval": cli_eval.cmd_eval,
    "sweep": cli_eval.cmd_sweep,
    **cli_deploy.COMMANDS,
    **cli_baseline.COMMANDS,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _env_defaults()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs every request at INFO: Prefect's API chatter would drown the stage log.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        return COMMANDS[args.command](args)
    except RecipeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
