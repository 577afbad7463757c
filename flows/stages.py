"""The `stage` flow (one pipeline stage, on the pool its recipe names) and the wiring of each stage's task.

`flows/pipeline.py` runs the stages in order through `draftsmith.flows.dispatch`, which calls `run_here` in the
flow run itself or starts this flow on the stage's pool (deployment `stage/<pool>`). Logic lives in `tasks/`
and `flows/dispatch.py`; this file only wires.
"""

from collections.abc import Mapping
from typing import Any, Literal

from prefect import flow

from draftsmith.core import heartbeat
from draftsmith.core.config import PipelineConfig
from draftsmith.core.manifest import StageManifest
from draftsmith.flows import dispatch
from draftsmith.flows.hidden_states import hidden_states_flow
from draftsmith.tasks.evaluate import evaluate_task
from draftsmith.tasks.hidden_states import hidden_states_task
from draftsmith.tasks.regenerate import regenerate_task
from draftsmith.tasks.select_prompts import select_prompts_task
from draftsmith.tasks.tokenization import tokenize_task
from draftsmith.tasks.train import train_task

Stage = Literal["select_prompts", "regenerate", "tokenize", "hidden_states", "train", "evaluate"]


def _bound(config: PipelineConfig, stage: str, inputs: Mapping[str, StageManifest | None]) -> tuple[Any, dict]:
    """The task of `stage` and its arguments but `run_dir`: what it runs and what its key is made of."""
    c = config
    if stage == "select_prompts":
        return select_prompts_task, {
            "cfg": c.select, "target": c.target, "seed": c.seed, "answer_tokens": c.regenerate.max_new_tokens,
        }  # fmt: skip
    if stage == "regenerate":
        return regenerate_task, {
            "cfg": c.regenerate,
            "target": c.target,
            "prompts": inputs["select_prompts"],
            "seed": c.seed,
        }
    if stage == "tokenize":
        return tokenize_task, {"cfg": c.tokenize, "target": c.target, "conversations": inputs["regenerate"]}
    if stage == "hidden_states":
        return hidden_states_task, {"cfg": c.hidden_states, "target": c.target, "tokens": inputs["tokenize"]}
    if stage == "train":
        return train_task, {
            "cfg": c.train, "drafter_cfg": c.drafter, "target": c.target, "hidden_cfg": c.hidden_states,
            "tokens": inputs["tokenize"], "hidden": inputs["hidden_states"], "seed": c.seed,
        }  # fmt: skip
    if stage == "evaluate":
        return evaluate_task, {
            "cfg": c.evaluate, "drafter_cfg": c.drafter, "target": c.target, "prompts": inputs["select_prompts"],
            "checkpoint": inputs["train"], "seed": c.seed,
        }  # fmt: skip
    raise ValueError(f"stage: {stage!r} is not one of {dispatch.STAGES}")


def stage_arguments(config: PipelineConfig, stage: str, inputs: Mapping[str, StageManifest | None]) -> dict[str, Any]:
    """What the pipeline gives `stage`'s work but where it writes: the arguments its key is made of. Code that
    runs a stage's function outside Prefect (the benchmarks) passes these, so that it finds what a run left
    under the same keys instead of recomputing it."""
    return _bound(config, stage, inputs)[1]


def run_here(
    config: PipelineConfig, stage: str, run_dir: str, inputs: Mapping[str, StageManifest | None]
) -> StageManifest | None:
    """Run `stage`'s task in this flow run on its upstream manifests `inputs` (`dispatch.UPSTREAM[stage]`)."""
    if stage == "hidden_states":  # a subflow: deployed on its own, it also serves online producers
        return hidden_states_flow(config, run_dir, inputs["tokenize"])
    task, args = _bound(config, stage, inputs)
    return task(**args, run_dir=run_dir)


def key_here(config: PipelineConfig, stage: str, inputs: Mapping[str, StageManifest | None]) -> str:
    """The key `stage` runs under on `inputs` (`draftsmith.core.stage.stage_key`, via the task's `stage_key`)."""
    task, args = _bound(config, stage, inputs)
    return task.stage_key(**args)


@flow(name="stage", flow_run_name="{stage}[{config.name}]", log_prints=True, validate_parameters=True)
def stage_flow(
    config: PipelineConfig, stage: Stage, run_dir: str, expected: dict[str, str] | None = None
) -> StageManifest | None:
    """Run one stage of `config` on the finished upstream stages under `run_dir`.

    `expected` maps each upstream stage to the manifest key the dispatching flow run finished it with; a run
    folder holding other keys is refused.
    """
    from prefect.runtime import flow_run

    # The dispatching flow run watches this heartbeat: a run that stops beating while Prefect still says
    # Running (its node lost with the worker) is marked Crashed there, not waited for forever.
    with heartbeat.beating(run_dir, stage, str(flow_run.id or ""), config.dispatch.heartbeat_s):
        inputs = dispatch.finished_inputs(config, stage, run_dir, expected or {})
        return run_here(config, stage, run_dir, inputs)
