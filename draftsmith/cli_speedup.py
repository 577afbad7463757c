"""`draftsmith speedup RUN`: a finished run's drafter in vLLM against plain serving and the engine's free
speculation (`draftsmith.evals.speedup`).

It exports the run's drafter, serves the target plain, with the drafter at each serving depth and with each free
method (n-gram prompt lookup, suffix decoding), sends the same prompts (built-in suites and the evaluation's
benchmark files, round-robin, never one twice) to each server in turn, and writes `speedup.json`, `speedup.md`
and `speedup.png` under `<run>/speedup/`. `speedup.json` also records the drafter's measured schedule (draft
tokens per batch size), which `draftsmith export` then serves. A result measured for the same checkpoint,
settings and prompts is printed again instead of measured again (`--force` measures anew).
"""

import argparse
import hashlib
import itertools
import json
import sys
from pathlib import Path

from pydantic import ValidationError

from draftsmith.core import manifest
from draftsmith.core.config import PipelineConfig, load_recipe
from draftsmith.core.config.select import SYNTHETIC_CATEGORIES
from draftsmith.core.config.sweep import SpeedupConfig

RESULT = "speedup.json"


def add_parsers(sub) -> None:
    p = sub.add_parser("speedup", help="a run's drafter in vLLM: tokens/s with speculation off vs on, interleaved")
    p.add_argument("run", help="a finished run folder, or the recipe whose default run folder to use")
    p.add_argument("--concurrency", help="comma list of levels (default: the recipe's speedup.concurrency)")
    p.add_argument("--rounds", type=int, help="timed runs per server and level (default: the recipe's)")
    p.add_argument(
        "--waves", type=int, help="requests per timed run, as a multiple of concurrency (default: the recipe's)"
    )
    p.add_argument(
        "--free-methods", help="comma list of free methods measured beside the drafter: ngram, suffix; none for none"
    )
    p.add_argument("--max-tokens", type=int, help="output tokens per request (default: the recipe's)")
    p.add_argument(
        "--draft-tokens",
        help="comma list of serving depths a chain drafter is measured at side by side, one server each "
        "(default: the recipe's speedup.draft_tokens, else evaluate.num_draft_tokens)",
    )
    p.add_argument("--force", action="store_true", help="measure again even if these settings were measured")


def _run_and_recipe(arg: str) -> tuple[Path, PipelineConfig]:
    from draftsmith.flows.pipeline import default_run_dir

    path = Path(arg)
    if path.is_file() and path.suffix in (".yaml", ".yml"):
        cfg = load_recipe(path)
        run_dir = Path(default_run_dir(cfg))
    else:
        if "://" in arg:
            raise ValueError(f"run: {arg} is a URL; vLLM serves from a local folder, so pass a local copy of the run")
        run_dir = path
        if not (run_dir / "recipe.yaml").exists():
            raise ValueError(f"run: {run_dir}/recipe.yaml not found; pass a finished run folder or its recipe")
        cfg = load_recipe(run_dir / "recipe.yaml")
    if not (run_dir / "train" / "manifest.json").exists():
        raise ValueError(f"run: {run_dir}/train holds no trained drafter; run the recipe first")
    return run_dir, cfg


def _levels(flag: str, text: str) -> tuple[int, ...]:
    try:
        return tuple(int(c) for c in text.split(","))
    except ValueError:
        raise ValueError(f"{flag}: expected a comma list of integers, got {text!r}") from None


def _settings(args: argparse.Namespace, recipe: SpeedupConfig) -> SpeedupConfig:
    """The recipe's `speedup:` section with the command line's flags laid over it."""
    given: dict = {k: getattr(args, k) for k in ("rounds", "waves", "max_tokens") if getattr(args, k) is not None}
    if args.free_methods is not None:
        text = args.free_methods.strip()
        given["free_methods"] = () if text in ("", "none") else tuple(m.strip() for m in text.split(","))
    if args.concurrency:
        given["concurrency"] = _levels("--concurrency", args.concurrency)
    if args.draft_tokens:
        given["draft_tokens"] = _levels("--draft-tokens", args.draft_tokens)
    try:
        return SpeedupConfig(**(recipe.model_dump() | given))
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "speedup"
        raise ValueError(f"{where}: {first['msg'].removeprefix('Value error, ')}") from None


def serving_depths(cfg: PipelineConfig, settings: SpeedupConfig) -> list[int | None]:
    """Draft tokens per step each speculating server is told; [None]: the export records them (block drafters)."""
    return cfg.drafter.serving_depths(settings.draft_tokens, cfg.evaluate.num_draft_tokens)


def run_prompts(cfg: PipelineConfig, run_dir: Path, settings: SpeedupConfig) -> list[str]:
    """Distinct first user turns for every request of the measurement, one from each benchmark in turn: the
    built-in suites the evaluation names, its benchmark files, and the held-out prompts when asked for (or when
    there is nothing else). Suites are drawn as deep as the measurement needs."""
    from draftsmith.core.stage import load_manifest
    from draftsmith.tasks.evaluate import benches_for

    needed = settings.prompts_needed()
    held_out = settings.held_out or (not cfg.evaluate.suites and not cfg.evaluate.bench_files)
    suites = len(SYNTHETIC_CATEGORIES) if cfg.evaluate.suites == ["all"] else len(cfg.evaluate.suites)
    sources = max(1, suites + len(cfg.evaluate.bench_files) + int(held_out))
    deep = cfg.evaluate.model_copy(
        update={
            "held_out": held_out,
            "prompts_per_suite": max(cfg.evaluate.prompts_per_suite, -(-needed // sources) + 2),
        }
    )
    benches = benches_for(deep, load_manifest(str(run_dir / "select_prompts")), cfg.seed)
    mixed = itertools.chain.from_iterable(itertools.zip_longest(*benches.values()))
    return list(dict.fromkeys(p.turns[0] for p in mixed if p is not None))[:needed]


def _measure(
    run_dir: Path, cfg: PipelineConfig, settings: SpeedupConfig, prompts: list[str], key: str, train_key: str
) -> dict:
    from draftsmith.core.target_setup import resolve_target
    from draftsmith.drafters.export import engines
    from draftsmith.drafters.export.bundle import export_run
    from draftsmith.evals.speedup import CPU_SERVE_ARGS, EAGER, measure_speedup

    platform = engines.detect_platform()
    exported = export_run(str(run_dir), "vllm", platform=platform)
    out = run_dir / "speedup"
    result = measure_speedup(
        str(resolve_target(cfg.target.source)),
        str(exported.folder),
        prompts,
        settings,
        depths=serving_depths(cfg, settings),
        serve_args=(
            *(CPU_SERVE_ARGS if platform == "cpu" else ("--dtype", "bfloat16")),
            *(() if settings.compile else EAGER),
        ),
        work_dir=str(out / "runs"),
    )
    return write_result(out, {"key": key, "train_key": train_key, "drafter": cfg.drafter.kind} | result)


def write_result(out: Path, result: dict) -> dict:
    """Add the served schedule to a measurement and write it to `out`: the plot, the table, then speedup.json."""
    from draftsmith.evals import plots
    from draftsmith.evals.results_page import SPEEDUP_PLOT
    from draftsmith.evals.speedup_report import batch_size_ranges, format_table, recommendation, schedule

    per_level = schedule(result)
    result["schedule"] = {
        "per_level": per_level,
        "batch_size_ranges": batch_size_ranges(per_level) if per_level else [],
    }
    out.mkdir(parents=True, exist_ok=True)
    plots.speedup_bars(result, out / SPEEDUP_PLOT)
    # Recorded with the figures it draws, so that a results page shows it only while it is still this plot.
    plot = manifest.entry(SPEEDUP_PLOT, (out / SPEEDUP_PLOT).read_bytes())
    result["files"] = {plot.name: plot.model_dump(exclude={"name"})}
    (out / "speedup.md").write_text(format_table(result) + "\n\n" + "\n".join(recommendation(result)) + "\n")
    (out / RESULT).write_text(json.dumps(result, indent=2) + "\n")  # last: its presence means complete
    return result


def cmd_speedup(args: argparse.Namespace) -> int:
    from draftsmith.evals.speedup_report import format_table, recommendation

    try:
        run_dir, cfg = _run_and_recipe(args.run)
        settings = _settings(args, cfg.speedup)
        depths = serving_depths(cfg, settings)
    except ValueError as err:
        print(f"speedup: {err}", file=sys.stderr)
        return 2
    train_key = json.loads((run_dir / "train" / "manifest.json").read_text()).get("key", "")
    try:
        prompts = run_prompts(cfg, run_dir, settings)
    except ValueError as err:
        print(f"speedup: {err}", file=sys.stderr)
        return 2
    # The depths served, not just the settings: a null draft_tokens follows evaluate.num_draft_tokens.
    served = [train_key, settings.model_dump(mode="json"), depths, prompts]
    key = hashlib.sha256(json.dumps(served).encode()).hexdigest()
    path = run_dir / "speedup" / RESULT
    cached = json.loads(path.read_text()) if path.exists() else None
    if cached is not None and cached.get("key") == key and not args.force:
        result, how = cached, "cached"
    else:
        result, how = _measure(run_dir, cfg, settings, prompts, key, train_key), "measured"
    print(
        f"speed-up in vLLM ({how}): {cfg.drafter.kind} drafter and free speculation against plain serving, runs "
        f"interleaved, {settings.waves} x concurrency requests x {settings.max_tokens} tokens per run, "
        f"{settings.rounds} rounds, every request a different prompt, greedy"
    )
    print(format_table(result))
    for line in recommendation(result):
        print(line)
    ranges = (result.get("schedule") or {}).get("batch_size_ranges")
    if ranges:
        print(f"served schedule (draftsmith export): draft tokens per batch size {_ranges_text(ranges)}")
    print(f"speed-up: {path} (plot {path.with_suffix('.png')})")
    return 0


def _ranges_text(ranges: list[list[int]]) -> str:
    return ", ".join(f"{a}{'' if a == b else f'-{b}'}: {k}" for a, b, k in ranges) + " (the last range goes on)"
