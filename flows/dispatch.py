"""Where a stage runs: in this flow run, or as a flow run of the `stage/<pool>` deployment on its own pool.

Each stage's recipe section names a work pool (`<stage>.resources.work_pool`). A `kimi-k3` flow run started by
a deployment runs on one pool (the cluster's: `cpu`); a stage of another pool (regeneration and hidden states
on `gb200`, training on `gb200-train`) is dispatched there with `run_deployment`, sized by the stage's
`resources` through the pool's job variables, and the parent waits for it. A flow run called directly (`make
run`, tests, the nightly regression's subflows) has no pool, so every stage runs in it.

The dispatched run reads its inputs from the run folder: the upstream stages' manifests, which must carry the
keys the parent passed (so a run folder changed in between fails loudly instead of training on other data).
Its stage folder holds the manifest the parent then reads back. `run_dir` must therefore be storage both
pools reach: S3 on a cluster, a local folder on one machine.

A rerun does not schedule a pod to learn that nothing changed: the parent computes the stage's key (the
same `draftsmith.core.stage.stage_key` the stage itself, and its Prefect cache key, use) and, when the stage folder
holds a current manifest for it (`valid_manifest`: every file with its recorded size and digest), answers from
the folder. A dispatched stage must finish with that key; one that finishes with another (a pool whose workers
run other code) is refused by name.

A dispatched stage's flow run is watched, not just awaited (`draftsmith.core.run_watch`): it writes a heartbeat
into the run folder (`draftsmith.core.heartbeat`), and one that Prefect still calls Running while its heartbeat
has stood still for `dispatch.lost_after_s` (its process killed with its node; Prefect would wait for it
forever) is marked Crashed, then dispatched again up to `dispatch.retries` times (the new run resumes from the
stage folder) or the parent fails with one line naming it. A run cancelled or deleted (from the UI) ends the
parent with one line too. Prefect guarantees relied on: a flow run's state is final only once its engine
reported it, a forced state is accepted whatever the run's current one, and `run_deployment(timeout=0)`
creates the run without waiting.
"""

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from draftsmith.core import run_watch, storage
from draftsmith.core.config import PipelineConfig
from draftsmith.core.config.stages import Resources
from draftsmith.core.manifest import StageManifest
from draftsmith.core.stage import load_manifest, valid_manifest

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun

log = logging.getLogger(__name__)

STAGE_FLOW = "stage"
# Each stage's inputs, by the upstream stages whose manifests it reads (pipeline order).
UPSTREAM: dict[str, tuple[str, ...]] = {
    "select_prompts": (),
    "regenerate": ("select_prompts",),
    "tokenize": ("regenerate",),
    "hidden_states": ("tokenize",),
    "train": ("tokenize", "hidden_states"),
    "evaluate": ("select_prompts", "train"),
}
STAGES = tuple(UPSTREAM)


class DispatchError(RuntimeError):
    """A stage that could not be run on its pool, or whose inputs in the run folder are not the expected ones."""


def resources(config: PipelineConfig, stage: str) -> Resources:
    """`config.<stage>.resources`: where the stage runs and how big its job is."""
    section = {"select_prompts": config.select}.get(stage) or getattr(config, stage)
    return section.resources


def skipped(config: PipelineConfig, stage: str) -> bool:
    """Online hidden states are streamed to the trainer by its own producers; there is no stage to run."""
    return stage == "hidden_states" and config.hidden_states.mode == "online"


def current_pool() -> str | None:
    """The work pool of this flow run, or None outside a run or for a run no worker started (direct calls)."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    run_id = flow_run.id
    if not run_id:
        return None
    with get_client(sync_client=True) as client:
        return client.read_flow_run(run_id).work_pool_name


def job_variables(resources: Resources, declared: Mapping[str, Any]) -> dict[str, Any]:
    """The stage's `resources` as the job variables its pool's template declares (`declared`: the template's
    `variables.properties`); a process pool declares none of them, so it gets none."""
    wanted = {
        "gpu_count": resources.gpus,
        "nnodes": resources.nodes,
        "cpu_request": str(resources.cpus),
        "memory_request": f"{resources.memory_gb}Gi",
        "memory_limit": f"{resources.memory_gb}Gi",
    }
    return {k: v for k, v in wanted.items() if k in declared}


def upstream_keys(stage: str, done: Mapping[str, StageManifest | None]) -> dict[str, str]:
    """`{upstream stage: manifest key}` of the finished inputs of `stage` (a skipped one has none)."""
    return {name: m.key for name in UPSTREAM[stage] if (m := done.get(name)) is not None}


def finished_inputs(config: PipelineConfig, stage: str, run_dir: str, expected: Mapping[str, str]) -> dict:
    """The upstream manifests of `stage` read from `run_dir`, each checked to hold the key the parent expects.

    Returns `{upstream stage: StageManifest | None}` (None for a skipped stage).
    """
    inputs: dict[str, StageManifest | None] = {}
    for name in UPSTREAM[stage]:
        if skipped(config, name):
            inputs[name] = None
            continue
        url = storage.join(run_dir, name)
        manifest = load_manifest(url)
        if manifest is None or not manifest.artifacts_present():
            raise DispatchError(
                f"stage {stage}: its input {name} is not finished under {url} (manifest.json with all its files)"
            )
        want = expected.get(name)
        if want is not None and manifest.key != want:
            raise DispatchError(
                f"stage {stage}: {url}/manifest.json has key {manifest.key[:12]}, but the flow run that dispatched "
                f"this stage finished {name} with key {want[:12]}; was the run folder changed in between?"
            )
        inputs[name] = manifest
    return inputs


Inputs = Mapping[str, StageManifest | None]


def run_stage(
    config: PipelineConfig,
    stage: str,
    run_dir: str,
    done: Inputs,
    here: Callable[[PipelineConfig, str, str, Inputs], StageManifest | None],
    pool: str | None,
    key_of: Callable[[PipelineConfig, str, Inputs], str],
) -> StageManifest | None:
    """Run `stage` in this process (`here(config, stage, run_dir, inputs)`) when it belongs to `pool` (this
    run's; None: no pool), else as a `stage/<its pool>` flow run that must finish with the stage key
    `key_of(config, stage, inputs)`; returns its manifest (None if skipped)."""
    if skipped(config, stage):
        return None
    inputs = {name: done.get(name) for name in UPSTREAM[stage]}
    target = resources(config, stage).work_pool
    if pool is None or target == pool:
        return here(config, stage, run_dir, inputs)
    return remote(config, stage, run_dir, upstream_keys(stage, done), key_of(config, stage, inputs))


def remote(config: PipelineConfig, stage: str, run_dir: str, expected: dict[str, str], key: str) -> StageManifest:
    """Run `stage` as a flow run of `stage/<pool>` unless `run_dir` holds its current result for `key`, wait
    for it, and read its manifest back from `run_dir`."""
    res = resources(config, stage)
    field = f"{'select' if stage == 'select_prompts' else stage}.resources.work_pool"
    deployment = f"{STAGE_FLOW}/{res.work_pool}"
    if storage.is_local(run_dir):
        run_dir = os.path.abspath(run_dir)  # the other worker need not start in this directory
    url = storage.join(run_dir, stage)
    done = valid_manifest(url, key)
    if done is not None:
        log.info("%s: up to date (%s); not dispatching", stage, done.uri)
        return done
    params = {"config": config.model_dump(mode="json"), "stage": stage, "run_dir": run_dir, "expected": expected}
    child = _run_watched(config, stage, run_dir, params, _Target(deployment, res.work_pool, field, res))
    state = child.state
    if state is None or not state.is_completed():
        name = state.name if state else "without a state"
        raise DispatchError(
            f"stage {stage}: flow run {child.name} ({child.id}) on pool {res.work_pool} ended {name}: "
            f"{(state.message if state else '') or 'no message'}"
        )
    manifest = load_manifest(url)
    if manifest is None:
        raise DispatchError(f"stage {stage}: flow run {child.name} completed, but {url} holds no finished manifest")
    if manifest.key != key:
        raise DispatchError(
            f"stage {stage}: flow run {child.name} on pool {res.work_pool} finished with key {manifest.key[:12]}, "
            f"but this flow run's code and inputs give {key[:12]}; do the pool's workers run another draftsmith?"
        )
    problem = manifest.problem()
    if problem is not None:
        raise DispatchError(f"stage {stage}: flow run {child.name} completed, but {problem}")
    return manifest


def _declared_variables(pool: str) -> dict[str, Any]:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        template = client.read_work_pool(pool).base_job_template
    return (template.get("variables") or {}).get("properties") or {}


@dataclass(frozen=True)
class _Target:
    """Where a dispatched stage runs: its deployment, pool, the recipe field naming the pool, its resources."""

    deployment: str
    pool: str
    field: str
    resources: Resources


def _run_watched(config: PipelineConfig, stage: str, run_dir: str, params: dict, target: _Target) -> "FlowRun":
    """Start `stage` as a flow run of its deployment and wait until it ends; one that is lost (Running, its
    heartbeat still for `dispatch.lost_after_s`) is marked Crashed and, like one that ended Crashed, started
    again `dispatch.retries` times; a lost one is then reported by name."""
    from prefect.client.orchestration import get_client

    attempts = config.dispatch.retries + 1
    for attempt in range(1, attempts + 1):
        child = _start(stage, config.name, params, target)
        if child.state is not None and child.state.is_final():
            return child  # it ended before it could be watched
        with get_client(sync_client=True) as client:
            try:
                run, lost = run_watch.watch(client, child, stage, run_dir, config.dispatch)
            except run_watch.WatchError as err:
                raise DispatchError(str(err)) from None
            if lost is None and not (attempt < attempts and run.state is not None and run.state.is_crashed()):
                return run
            if lost is None:  # its infrastructure failed (Prefect says Crashed): as good as lost
                lost = f"it ended Crashed: {run.state.message if run.state else ''}"
            else:
                run_watch.mark_crashed(client, child, lost)
        again = f"; dispatching it again ({attempt} of {attempts - 1} retries)" if attempt < attempts else ""
        log.warning("%s: flow run %s on pool %s did not finish (%s)%s", stage, child.name, target.pool, lost, again)
    raise DispatchError(
        f"stage {stage}: flow run {child.name} ({child.id}) on pool {target.pool} was lost: {lost}; marked Crashed"
        f"{f' after {attempts} attempts' if attempts > 1 else ''}. Check the pool's workers, then rerun: finished "
        "stages are reused (dispatch.retries dispatches a lost stage again by itself)"
    )


def _start(stage: str, name: str, params: dict, target: _Target) -> "FlowRun":
    """A new flow run of the stage's deployment, not waited for."""
    from prefect.deployments import run_deployment
    from prefect.exceptions import ObjectNotFound

    try:
        variables = job_variables(target.resources, _declared_variables(target.pool))
        log.info("%s: on pool %s (deployment %s, job variables %s)", stage, target.pool, target.deployment, variables)
        child = run_deployment(
            target.deployment, parameters=params, job_variables=variables, flow_run_name=f"{stage}[{name}]", timeout=0
        )
    except ObjectNotFound as exc:
        raise DispatchError(
            f"stage {stage}: {target.field} is {target.pool!r}, which is not this flow run's pool, and the server has "
            f"no work pool or deployment {target.deployment!r} to run it there; `draftsmith deploy` creates both"
        ) from exc
    return cast("FlowRun", child)  # called from sync code, run_deployment returns the run, not a coroutine
