"""The `stage` flow (one pipeline stage, on the pool its recipe names) and the wiring of each stage's task.

`flows/pipeline.py` runs the stages in order through `draftsmith.dispatch`, which calls `run_here` in the
flow run itself or starts this flow on the stage's pool (deployment `stage/<pool>`). Logic lives in `tasks/`
and `draftsmith/dispatch.py`; this file only wires.
"""

from collections.abc import Mapping
from typing import Literal

from prefect import flow

from draftsmith import dispatch
from draftsmith.config import PipelineConfig
from draftsmith.manifest import StageManifest
from flows.hidden_states import hidden_states_flow
from tasks.evaluate import evaluate_task
from tasks.regenerate import regenerate_task
from tasks.select_prompts import select_prompts_task
from tasks.tokenization import tokenize_task
from tasks.train import train_task

Stage = Literal["select_prompts", "regenerate", "tokenize", "hidden_states", "train", "evaluate"]


def run_here(
    config: PipelineConfig, stage: str, run_dir: str, inputs: Mapping[str, StageManifest | None]
) -> StageManifest | None:
    """Run `stage`'s task in this flow run on its upstream manifests `inputs` (`dispatch.UPSTREAM[stage]`)."""
    c = config
    if stage == "select_prompts":
        return select_prompts_task(c.select, c.target, c.seed, run_dir, c.regenerate.max_new_tokens)
    if stage == "regenerate":
        return regenerate_task(c.regenerate, c.target, inputs["select_prompts"], c.seed, run_dir)
    if stage == "tokenize":
        return tokenize_task(c.tokenize, c.target, inputs["regenerate"], run_dir)
    if stage == "hidden_states":
        return hidden_states_flow(c, run_dir, inputs["tokenize"])
    if stage == "train":
        hidden = inputs["hidden_states"]
        return train_task(c.train, c.drafter, c.target, c.hidden_states, inputs["tokenize"], hidden, c.seed, run_dir)
    if stage == "evaluate":
        prompts, checkpoint = inputs["select_prompts"], inputs["train"]
        return evaluate_task(c.evaluate, c.drafter, c.target, prompts, checkpoint, run_dir, c.seed)
    raise ValueError(f"stage: {stage!r} is not one of {dispatch.STAGES}")


@flow(name="stage", flow_run_name="{stage}[{config.name}]", log_prints=True, validate_parameters=True)
def stage_flow(
    config: PipelineConfig, stage: Stage, run_dir: str, expected: dict[str, str] | None = None
) -> StageManifest | None:
    """Run one stage of `config` on the finished upstream stages under `run_dir`.

    `expected` maps each upstream stage to the manifest key the dispatching flow run finished it with; a run
    folder holding other keys is refused.
    """
    inputs = dispatch.finished_inputs(config, stage, run_dir, expected or {})
    return run_here(config, stage, run_dir, inputs)
