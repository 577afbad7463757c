"""The `kimi-k3` flow: the six stages chained, each where its recipe section's `resources.work_pool` says.

Logic lives in `tasks/` and `flows/dispatch.py`; this file only wires it.
"""

from prefect import flow

from draftsmith.core import runlock, storage
from draftsmith.core.config import PipelineConfig, check_target_shape, record_recipe
from draftsmith.core.manifest import StageManifest
from draftsmith.evals import results_page
from draftsmith.flows import dispatch
from draftsmith.flows.stages import key_here, run_here

_STAGE_ATTR = "draftsmith_stage"


def default_run_dir(config: PipelineConfig) -> str:
    return storage.join(config.storage.run_root, config.name)


def failed_stage(err: BaseException) -> str | None:
    """The stage whose failure `err` is, when it came out of `kimi_k3`; None for a failure outside the stages."""
    return getattr(err, _STAGE_ATTR, None)


@flow(name="kimi-k3", flow_run_name="{config.name}", log_prints=True, validate_parameters=True)
def kimi_k3(config: PipelineConfig, run_dir: str | None = None) -> dict[str, StageManifest | None]:
    """Select prompts, regenerate, tokenize, capture hidden states, train and evaluate a drafter.

    Started by a worker, the stages of other work pools run as `stage/<pool>` flow runs there; called
    directly, every stage runs here. Online hidden states have no stage: training consumes the stream.
    """
    # Before the lock and any stage: a run started from the UI or `prefect deployment run` (which check the
    # recipe's schema only) fails here at once, naming the field, rather than in a stage minutes later.
    check_target_shape(config, origin=f"recipe {config.name!r}")
    run_dir = run_dir or default_run_dir(config)
    # Taken here, not in the CLI, so deployment runs hold it too; the `stage/<pool>` flow runs this one
    # dispatches write while it holds the lock and take none of their own.
    with runlock.hold(run_dir, lease_s=config.storage.lock_lease_s):
        record_recipe(config, run_dir)
        pool = dispatch.current_pool()
        done: dict[str, StageManifest | None] = {}
        for stage in dispatch.STAGES:
            try:
                done[stage] = dispatch.run_stage(config, stage, run_dir, done, run_here, pool, key_of=key_here)
            except Exception as err:
                # Tagged, not wrapped: retry policies and callers still see the stage's own exception type.
                setattr(err, _STAGE_ATTR, stage)
                raise
        # Here, not in a stage: a run whose stages all came from a cache still shows its results.
        results_page.publish(run_dir, with_doctor=config.evaluate.doctor)
        return done
