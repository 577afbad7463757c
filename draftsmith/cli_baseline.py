"""`draftsmith baseline update`: the only way the nightly regression's baselines change.

It runs the nightly flow (or reads the runs it already made, `--from`), records each drafter's figures in
`<baseline_dir>/nightly-<drafter>.json` and prints every figure old -> new, so the change is reviewed in the
commit that carries it.
"""

import argparse
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from draftsmith.core.config import NightlyConfig
from draftsmith.core.config.drafter import drafter_kinds


def _config(args: argparse.Namespace) -> NightlyConfig:
    data: dict[str, Any] = {}
    if args.config:
        data = yaml.safe_load(Path(args.config).read_text(encoding="utf-8")) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{args.config}: a nightly config must be a YAML mapping")
    for flag, field in (("run_root", "run_root"), ("run_name", "run_name"), ("baseline_dir", "baseline_dir")):
        if getattr(args, flag):
            data[field] = getattr(args, flag)
    if args.drafter:
        data["drafters"] = args.drafter
    cfg = NightlyConfig.model_validate(data)
    if cfg.overrides:
        raise ValueError(
            f"overrides: {cfg.overrides} would record figures of a recipe the nightly does not run; "
            "change the nightly recipes instead"
        )
    return cfg


def _run_folder(cfg: NightlyConfig, source: str | None) -> tuple[NightlyConfig, str]:
    """The folder holding `nightly-<drafter>/` runs: `--from`, or a nightly run made now."""
    from draftsmith.core import storage

    if source:
        return cfg, source
    from draftsmith.flows.nightly import nightly_regression

    name = cfg.run_name or datetime.now(UTC).strftime("baseline-%Y%m%dT%H%M%SZ")
    cfg = NightlyConfig.model_validate(cfg.model_dump() | {"run_name": name})
    # Out-of-band figures fail the flow; that is what an update is for, so only the runs matter here.
    nightly_regression(config=cfg, return_state=True)
    return cfg, storage.join(cfg.run_root, name)


def cmd_baseline_update(args: argparse.Namespace) -> int:
    from draftsmith.core import storage
    from draftsmith.tasks import regression

    try:
        cfg = _config(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)  # noqa: T201 - the CLI's output
        return 2
    cfg, folder = _run_folder(cfg, args.source)
    try:
        fresh = []
        for drafter in cfg.drafters:
            recipe = regression.nightly_recipe(cfg, drafter)
            run_dir = storage.join(folder, recipe.name)
            figures = regression.read_figures(run_dir, cfg.bands.curve_windows)
            fresh.append(regression.make_baseline(recipe, figures, run_dir, cfg.bands))
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}; no baseline was changed", file=sys.stderr)  # noqa: T201
        return 1
    for new in fresh:  # written only once every drafter's run was read and healthy
        old = regression.load_baseline(cfg.baseline_dir, new.drafter)
        url = regression.baseline_path(cfg.baseline_dir, new.drafter)
        storage.write_json(url, new.model_dump(mode="json"))
        print(f"{url} (from {new.recorded_from}):")  # noqa: T201
        for line in regression.baseline_diff(old, new):
            print(f"  {line}")  # noqa: T201
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("baseline", help="the nightly regression's committed baselines")
    verbs = p.add_subparsers(dest="baseline_command", required=True)
    u = verbs.add_parser(
        "update",
        help="run the nightly flow (or read its finished runs) and rewrite the baselines, printing old -> new",
    )
    u.add_argument("--config", help="nightly config YAML (NightlyConfig fields; default: the committed settings)")
    u.add_argument("--run-root", help="folder under which the nightly runs are made (default: runs/nightly)")
    u.add_argument("--run-name", help="run folder under --run-root (reuses its finished stages)")
    u.add_argument("--from", dest="source", help="read finished runs from this folder instead of running")
    u.add_argument("--baseline-dir", help="where to write the baselines (default: deployments/baselines)")
    u.add_argument("--drafter", action="append", choices=drafter_kinds(), help="only this drafter (repeatable)")


def cmd_baseline(args: argparse.Namespace) -> int:
    return {"update": cmd_baseline_update}[args.baseline_command](args)


COMMANDS = {"baseline": cmd_baseline}
