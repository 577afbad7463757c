"""The `kimi-k3` flow: the six stages chained, each where its recipe section's `resources.work_pool` says.

Logic lives in `tasks/` and `draftsmith/dispatch.py`; this file only wires it.
"""

from prefect import flow

from draftsmith import dispatch, storage
from draftsmith.config import PipelineConfig, record_recipe
from draftsmith.manifest import StageManifest
from flows.stages import run_here


def default_run_dir(config: PipelineConfig) -> str:
    return storage.join(config.storage.run_root, config.name)


@flow(name="kimi-k3", flow_run_name="{config.name}", log_prints=True, validate_parameters=True)
def kimi_k3(config: PipelineConfig, run_dir: str | None = None) -> dict[str, StageManifest | None]:
    """Select prompts, regenerate, tokenize, capture hidden states, train and evaluate a drafter.

    Started by a worker, the stages of other work pools run as `stage/<pool>` flow runs there; called
    directly, every stage runs here. Online hidden states have no stage: training consumes the stream.
    """
    run_dir = run_dir or default_run_dir(config)
    record_recipe(config, run_dir)
    pool = dispatch.current_pool()
    done: dict[str, StageManifest | None] = {}
    for stage in dispatch.STAGES:
        done[stage] = dispatch.run_stage(config, stage, run_dir, done, run_here, pool)
    return done
