"""`draftsmith submit`: start a deployment run after checking its recipe whole, on the server in PREFECT_API_URL.

The Prefect UI and `prefect deployment run` check a run's parameters against the deployment's JSON schema only:
field types and ranges. Rules across fields (a tap beyond the target's layers, a draft vocabulary larger than
the target's) and the target's shape against its config.json need the recipe model, so such a run is created,
picked up by a worker and only then refused. `submit` applies every rule first and creates no flow run for a
recipe that breaks one; the run it creates carries the recipe's name from the start.
"""

import argparse
import sys
from pathlib import Path
from typing import Any

from draftsmith.cli_recipe import overrides
from draftsmith.core.config import PipelineConfig, RecipeError, load_recipe, note_overrides, parse_recipe
from draftsmith.core.config.loader import apply_overrides


class SubmitError(RuntimeError):
    """No server, or no such deployment on it."""


def _server() -> str:
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        # Without one Prefect would start a temporary server and create the run where no worker will see it.
        raise SubmitError("PREFECT_API_URL is not set: `draftsmith submit` starts runs on a running Prefect server")
    return url


def _deployment(name: str) -> Any:
    """The deployment `FLOW/NAME` on the server; `SubmitError` when there is none."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            return client.read_deployment_by_name(name)
        except ObjectNotFound:
            raise SubmitError(f"deployment {name!r}: not found on {_server()} (`draftsmith deploy` makes it)") from None


def _deployment_config(name: str, deployment: Any = None) -> dict[str, Any]:
    """The recipe a deployment runs by default (its `config` parameter); `deployment` when already read."""
    config = ((deployment or _deployment(name)).parameters or {}).get("config")
    if not isinstance(config, dict):
        raise SubmitError(f"deployment {name!r}: has no default recipe; give one (draftsmith submit {name} RECIPE)")
    return config


def recipe_for(name: str, recipe: Path | None, sets: dict[str, Any], deployment: Any = None) -> PipelineConfig:
    """The recipe file with `--set` overrides, or else the deployment's own, checked as `draftsmith run` checks
    it except for local files, which the workers read, not this machine."""
    if recipe is not None:
        try:
            return load_recipe(recipe, sets, files=False)
        except RecipeError as err:
            raise note_overrides(err, list(sets), str(recipe), "from --set") from None
    origin = f"deployment {name!r}"
    data = _deployment_config(name, deployment)
    apply_overrides(data, sets, origin)
    try:
        return parse_recipe(data, origin, files=False)
    except RecipeError as err:
        raise note_overrides(err, list(sets), origin, "from --set") from None


def cmd_submit(args: argparse.Namespace) -> int:
    try:
        _server()
        deployment = _deployment(args.deployment)
        cfg = recipe_for(args.deployment, args.recipe, overrides(args.set or []), deployment)
    except SubmitError as err:
        print(f"error: {err}", file=sys.stderr)  # noqa: T201 - the CLI's output
        return 2
    from prefect.client.orchestration import get_client

    params: dict[str, Any] = {"config": cfg.model_dump(mode="json")}
    if args.run_dir:
        params["run_dir"] = args.run_dir
    with get_client(sync_client=True) as client:
        run = client.create_flow_run_from_deployment(deployment.id, parameters=params, name=cfg.name)
    print(f"flow run {run.id} ({run.name}) of {args.deployment} created: recipe {cfg.name!r} checked")  # noqa: T201
    return 0


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("submit", help="check a recipe whole, then start a deployment run on PREFECT_API_URL's server")
    p.add_argument("deployment", help="FLOW/DEPLOYMENT, e.g. kimi-k3/dspark")
    p.add_argument("recipe", type=Path, nargs="?", help="YAML recipe (default: the deployment's own)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a dotted recipe field")
    p.add_argument("--run-dir", help="run folder or URL (default: <storage.run_root>/<name>)")


COMMANDS = {"submit": cmd_submit}
