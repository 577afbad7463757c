"""`draftsmith deploy`: the work pools, concurrency limits, result-storage block and deployments of a prefect file.

Idempotent: every object is read first and written only when it differs, and each is reported `created`,
`updated` or `unchanged`, so a second run changes nothing and says so.

Pools, limits and the block go through the Prefect Python client: typed reads and writes, "not found" as an
exception rather than CLI text to parse, and an update in place where `prefect work-pool create` would refuse.
The deployments go through `prefect deploy --all --prefect-file`: that command is what interprets a prefect
file (its build and pull steps, `{{ step.output }}` templating, job variables checked against the pool), and
redoing it here would drift from Prefect. Each deployment is read back before and after to report it.
"""

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from draftsmith.core.config.base import StrictModel
from draftsmith.pools import (
    WORK_POOLS_DIR,
    gpu_limit_name,
    gpu_pool_concurrency,
    load_base_job_template,
    validate_pool_template,
)

ROOT = WORK_POOLS_DIR.parents[1]
INVENTORY = WORK_POOLS_DIR / "pools.yaml"
PREFECT_FILE = ROOT / "deployments" / "prefect.yaml"
LOCAL_PREFECT_FILE = ROOT / "deployments" / "prefect.local.yaml"
# Prefect's block type for any fsspec URL: s3:// goes through s3fs.
RESULT_BLOCK_TYPE = "remote-file-system"
DEPLOY_TIMEOUT_S = 600
# What a deployment is, for comparing two reads of it (ids and timestamps left out).
_DEPLOYMENT_FIELDS = (
    "entrypoint",
    "work_pool_name",
    "work_queue_name",
    "parameters",
    "parameter_openapi_schema",
    "job_variables",
    "tags",
    "description",
    "pull_steps",
    "enforce_parameter_schema",
    "paused",
)


class DeployError(ValueError):
    """A pool inventory, prefect file or server state `draftsmith deploy` cannot apply; names the file and field."""


class PoolSpec(StrictModel):
    """One work pool: its type, and either a flow-run limit (CPU pools) or its GPUs (GPU pools)."""

    type: Literal["process", "kubernetes"] = Field(description="Prefect work pool type.")
    description: str = Field(min_length=1, description="Shown in the Prefect UI's work pool list.")
    concurrency_limit: int | None = Field(
        None, ge=1, description="Flow runs at a time (CPU pools; GPU pools derive it)."
    )
    gpus: int = Field(0, ge=0, description="GPUs of the pool in the cluster: slots of its `gpu:<pool>` limit.")

    @model_validator(mode="after")
    def _one_limit(self) -> "PoolSpec":
        if self.gpus and self.concurrency_limit is not None:
            raise ValueError("concurrency_limit: a GPU pool derives it from gpus // (GPUs per flow run); drop it")
        return self


class ResultStorage(StrictModel):
    """Prefect's default result storage: a `remote-file-system` block holding a base path and nothing else."""

    block: str = Field(min_length=1, description="Name of the remote-file-system block.")
    basepath: str = Field(description="fsspec URL results go under, e.g. s3://bucket/prefect-results.")

    @model_validator(mode="after")
    def _url_without_credentials(self) -> "ResultStorage":
        scheme, sep, rest = self.basepath.partition("://")
        if not sep or not scheme:
            raise ValueError(f"basepath: {self.basepath!r} is not a URL (e.g. s3://bucket/prefect-results)")
        if "@" in rest.split("/", 1)[0]:
            raise ValueError("basepath: credentials in the URL; let s3fs read them from the environment")
        return self


class Inventory(StrictModel):
    """`deployments/work-pools/pools.yaml`: every pool a prefect file may name, and where results go."""

    pools: dict[str, PoolSpec] = Field(description="Work pools by name; `<name>.json` is the base job template.")
    result_storage: ResultStorage | None = Field(None, description="Result storage of cluster deployments.")


@dataclass(frozen=True)
class Change:
    """One object `deploy` looked at: what it is, and `created`, `updated` or `unchanged`."""

    kind: str
    name: str
    action: str

    def __str__(self) -> str:
        return f"{self.kind:<18} {self.name:<40} {self.action}"


def _dotted_errors(err: ValidationError, origin: Path) -> str:
    return "\n".join(
        f"{origin}: {'.'.join(map(str, e['loc']))}: {e['msg'].removeprefix('Value error, ')}" for e in err.errors()
    )


def load_inventory(path: Path = INVENTORY) -> Inventory:
    """Read and validate the pool inventory; errors name the file and the dotted field."""
    try:
        return Inventory.model_validate(yaml.safe_load(path.read_text()))
    except FileNotFoundError as exc:
        raise DeployError(f"{path}: no pool inventory there") from exc
    except ValidationError as exc:
        raise DeployError(_dotted_errors(exc, path)) from exc


def load_prefect_file(path: Path) -> list[dict[str, Any]]:
    """The deployments of a prefect file, each checked for a name, an entrypoint and a work pool name."""
    try:
        doc = yaml.safe_load(path.read_text())
    except FileNotFoundError as exc:
        raise DeployError(f"{path}: no prefect file there") from exc
    deployments = (doc or {}).get("deployments")
    if not isinstance(deployments, list) or not deployments:
        raise DeployError(f"{path}: deployments: none defined")
    for i, dep in enumerate(deployments):
        for key in ("name", "entrypoint"):
            if not isinstance(dep.get(key), str):
                raise DeployError(f"{path}: deployments[{i}].{key}: missing")
        if not isinstance((dep.get("work_pool") or {}).get("name"), str):
            raise DeployError(f"{path}: deployments[{i}].work_pool.name: missing ({dep['name']})")
        # `prefect deploy --all` stops at the first missing file, after deploying the ones before it.
        source = ROOT / dep["entrypoint"].partition(":")[0]
        if not source.is_file():
            raise DeployError(f"{path}: deployments[{i}].entrypoint: {source} does not exist ({dep['name']})")
    return deployments


def pools_used(deployments: list[dict[str, Any]], inventory: Inventory, origin: Path) -> list[str]:
    """Names of the pools the deployments run on, in first-use order; each must be in the inventory."""
    used: list[str] = []
    for i, dep in enumerate(deployments):
        pool = dep["work_pool"]["name"]
        if pool not in inventory.pools:
            raise DeployError(
                f"{origin}: deployments[{i}].work_pool.name: {pool!r} ({dep['name']}) is not in {INVENTORY.name} "
                f"(known: {sorted(inventory.pools)})"
            )
        if pool not in used:
            used.append(pool)
    return used


def pool_settings(name: str, spec: PoolSpec, gpus: int | None = None) -> tuple[dict[str, Any], int, int]:
    """`(base job template, flow-run limit, GPU slots)` of pool `name`; the template is validated first.

    `gpus` overrides the inventory's GPU count. A GPU pool runs `gpus // (gpu_count x nodes)` flow runs at a time.
    """
    template = load_base_job_template(name)
    gpus = spec.gpus if gpus is None else gpus
    problems = validate_pool_template(spec.type, template, gpu=gpus > 0)
    if problems:
        raise DeployError(f"work pool {name!r}: invalid base job template:\n  " + "\n  ".join(problems))
    if not gpus:
        return template, spec.concurrency_limit or 1, 0
    try:
        return template, gpu_pool_concurrency(template, gpus), gpus
    except ValueError as exc:
        raise DeployError(f"work pool {name!r}: {exc}") from exc


def _prefect_executable() -> str:
    """The `prefect` beside this interpreter (the venv's), not whichever comes first on PATH."""
    beside = Path(sys.executable).parent / "prefect"
    return str(beside) if beside.exists() else "prefect"


def run_prefect_deploy(prefect_file: Path) -> str:
    """`prefect --no-prompt deploy --all --prefect-file FILE` from the repository root; its output, or DeployError."""
    rel = (
        prefect_file.resolve().relative_to(ROOT.resolve())
        if prefect_file.resolve().is_relative_to(ROOT)
        else prefect_file
    )
    argv = [_prefect_executable(), "--no-prompt", "deploy", "--all", "--prefect-file", str(rel)]
    res = subprocess.run(
        argv, cwd=ROOT, env=os.environ.copy(), capture_output=True, text=True, timeout=DEPLOY_TIMEOUT_S
    )
    out = res.stdout + res.stderr
    if res.returncode != 0:
        # The server's refusal (a parameter or job variable failing its schema) is on the last lines.
        tail = "\n".join(out.strip().splitlines()[-12:])
        raise DeployError(f"`prefect deploy --all --prefect-file {rel}` exited {res.returncode}:\n{tail}")
    return out


def _require_api_url() -> str:
    """The server to deploy to; without one, Prefect would start a throwaway server and deploy into it."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        raise DeployError(
            "PREFECT_API_URL is not set: `draftsmith deploy` registers pools and deployments on a running Prefect "
            "server (e.g. `prefect server start`, then export PREFECT_API_URL=http://127.0.0.1:4200/api)"
        )
    return url


def ensure_pool(client: Any, name: str, spec: PoolSpec, template: dict[str, Any], limit: int) -> Change:
    """Create work pool `name`, or bring its template, description and flow-run limit to these; never its type."""
    from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
    from prefect.exceptions import ObjectNotFound

    want = {"description": spec.description, "base_job_template": template, "concurrency_limit": limit}
    try:
        pool = client.read_work_pool(name)
    except ObjectNotFound:
        client.create_work_pool(WorkPoolCreate(name=name, type=spec.type, **want))
        return Change("work pool", name, "created")
    if pool.type != spec.type:
        raise DeployError(
            f"work pool {name!r}: exists with type {pool.type!r}, {INVENTORY.name} says {spec.type!r}; "
            f"`prefect work-pool delete {name}` first if it should be replaced"
        )
    differs = {key: value for key, value in want.items() if getattr(pool, key) != value}
    if not differs:
        return Change("work pool", name, "unchanged")
    client.update_work_pool(name, WorkPoolUpdate(**differs))
    return Change("work pool", name, "updated " + ", ".join(sorted(differs)))


def ensure_gpu_limit(client: Any, pool: str, gpus: int) -> Change:
    """The global concurrency limit `gpu:<pool>` with one slot per GPU, active."""
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, GlobalConcurrencyLimitUpdate
    from prefect.exceptions import ObjectNotFound

    name = gpu_limit_name(pool)
    try:
        limit = client.read_global_concurrency_limit_by_name(name)
    except ObjectNotFound:
        client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=gpus, active=True))
        return Change("concurrency limit", name, f"created ({gpus} slots)")
    if limit.limit == gpus and limit.active:
        return Change("concurrency limit", name, "unchanged")
    client.update_global_concurrency_limit(name, GlobalConcurrencyLimitUpdate(limit=gpus, active=True))
    return Change("concurrency limit", name, f"updated ({limit.limit} -> {gpus} slots)")


def ensure_result_block(client: Any, storage: ResultStorage) -> Change:
    """The `remote-file-system/<block>` result storage block: a base path, no settings, so no credentials."""
    from prefect.exceptions import ObjectNotFound
    from prefect.filesystems import RemoteFileSystem

    slug = f"{RESULT_BLOCK_TYPE}/{storage.block}"
    want = {"basepath": storage.basepath, "settings": {}}
    try:
        have = client.read_block_document_by_name(storage.block, RESULT_BLOCK_TYPE).data
    except ObjectNotFound:
        have = None
    if have == want:
        return Change("result storage", slug, "unchanged")
    RemoteFileSystem(**want).save(storage.block, overwrite=True)
    return Change("result storage", slug, "created" if have is None else "updated")


def _snapshot(client: Any, deployments: list[dict[str, Any]]) -> dict[str, tuple[str, dict[str, Any]]]:
    """`{id: (flow/deployment, fields)}` of the server's deployments that the prefect file defines."""
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    wanted = {(d["name"], d["entrypoint"]) for d in deployments}
    names = sorted({name for name, _ in wanted})
    found = client.read_deployments(deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=names)))
    out = {}
    for dep in found:
        if (dep.name, dep.entrypoint) not in wanted:
            continue
        fields = {key: getattr(dep, key) for key in _DEPLOYMENT_FIELDS}
        fields["concurrency_limit"] = getattr(dep.global_concurrency_limit, "limit", None)
        fields["schedules"] = sorted(
            (yaml.safe_dump(s.schedule.model_dump(mode="json"), sort_keys=True), s.active) for s in dep.schedules
        )
        out[str(dep.id)] = (f"{client.read_flow(dep.flow_id).name}/{dep.name}", fields)
    return out


def _deployment_changes(before: dict, after: dict, deployments: list[dict[str, Any]], origin: Path) -> list[Change]:
    if len(after) != len({(d["name"], d["entrypoint"]) for d in deployments}):
        raise DeployError(
            f"{origin}: {len(deployments)} deployments defined, {len(after)} found on the server after deploy"
        )
    changes = []
    for dep_id, (full_name, fields) in sorted(after.items(), key=lambda kv: kv[1][0]):
        if dep_id not in before:
            action = "created"
        else:
            differs = sorted(key for key, value in fields.items() if before[dep_id][1].get(key) != value)
            action = "updated " + ", ".join(differs) if differs else "unchanged"
        changes.append(Change("deployment", full_name, action))
    return changes


def deploy(
    prefect_file: Path, *, local: bool, inventory_path: Path = INVENTORY, gpus: dict[str, int] | None = None
) -> list[Change]:
    """Create or update the pools, their limits, the result block (not `local`) and the file's deployments.

    `gpus` overrides the inventory's GPU count per pool (`{"gb200": 32}`). Returns what was done, in order.
    """
    inventory = load_inventory(inventory_path)
    deployments = load_prefect_file(prefect_file)
    used = pools_used(deployments, inventory, prefect_file)
    gpus = gpus or {}
    if unknown := sorted(set(gpus) - {p for p in used if inventory.pools[p].gpus}):
        raise DeployError(
            f"--gpus {unknown}: not GPU pools of {prefect_file} (GPU pools there: "
            f"{[p for p in used if inventory.pools[p].gpus]})"
        )
    settings = {name: pool_settings(name, inventory.pools[name], gpus.get(name)) for name in used}
    _require_api_url()
    from prefect.client.orchestration import get_client

    changes = []
    with get_client(sync_client=True) as client:
        for name in used:
            template, limit, slots = settings[name]
            changes.append(ensure_pool(client, name, inventory.pools[name], template, limit))
            if slots:
                changes.append(ensure_gpu_limit(client, name, slots))
        if not local and inventory.result_storage is not None:
            changes.append(ensure_result_block(client, inventory.result_storage))
        before = _snapshot(client, deployments)
        run_prefect_deploy(prefect_file)
        after = _snapshot(client, deployments)
    return changes + _deployment_changes(before, after, deployments, prefect_file)
