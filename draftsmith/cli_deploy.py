"""`draftsmith deploy`: work pools, concurrency limits and deployments on the Prefect server in PREFECT_API_URL.

The work is in `draftsmith.deploy`; this module parses arguments and prints what was done.
"""

import argparse
import sys
from pathlib import Path


def _gpu_overrides(pairs: list[str]) -> dict[str, int]:
    out = {}
    for pair in pairs:
        pool, sep, value = pair.partition("=")
        if not sep or not pool or not value.isdigit() or int(value) < 1:
            raise ValueError(f"--gpus {pair!r}: expected POOL=N with N >= 1, e.g. gb200=32")
        out[pool] = int(value)
    return out


def cmd_deploy(args: argparse.Namespace) -> int:
    from draftsmith.deploy import INVENTORY, LOCAL_PREFECT_FILE, PREFECT_FILE, DeployError, deploy

    prefect_file = Path(args.prefect_file) if args.prefect_file else LOCAL_PREFECT_FILE if args.local else PREFECT_FILE
    try:
        gpus = _gpu_overrides(args.gpus)
        changes = deploy(prefect_file, local=args.local, inventory_path=Path(args.pools or INVENTORY), gpus=gpus)
    except (DeployError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)  # noqa: T201 - the CLI's output
        return 2
    for change in changes:
        print(change)  # noqa: T201
    changed = sum(c.action != "unchanged" for c in changes)
    summary = f"{len(changes)} objects, {changed} created or updated, {len(changes) - changed} unchanged"
    print(f"{prefect_file}: {summary}")  # noqa: T201
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser(
        "deploy",
        help="create the work pools, concurrency limits and deployments on the server in PREFECT_API_URL (idempotent)",
    )
    p.add_argument(
        "--local",
        action="store_true",
        help="the laptop set-up: deployments/prefect.local.yaml on the `local` process pool, results kept locally",
    )
    p.add_argument("--prefect-file", help="prefect file to deploy (default: deployments/prefect.yaml, or .local.yaml)")
    p.add_argument("--pools", help="pool inventory (default: deployments/work-pools/pools.yaml)")
    p.add_argument(
        "--gpus", action="append", default=[], metavar="POOL=N", help="GPUs of a GPU pool in the cluster (repeatable)"
    )


COMMANDS = {"deploy": cmd_deploy}
