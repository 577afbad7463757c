"""The pipeline's data stages, select → regenerate → tokenize → hidden states, run outside Prefect for the
benchmarks, with the arguments the pipeline gives them (`draftsmith.flows.stages.stage_arguments`). A benchmark
run after `draftsmith run` then finds the stages cached in the run folder: a stage key holds every argument (the
select key holds the answer length, which bounds prompt length), and a call that left one to its default once
recomputed the run from its first stage.
"""

from collections.abc import Callable
from typing import Any

from draftsmith.core import storage
from draftsmith.core.config import PipelineConfig
from draftsmith.core.manifest import StageManifest
from draftsmith.flows.stages import stage_arguments

DATA_STAGES = ("select_prompts", "regenerate", "tokenize", "hidden_states")


def stage_functions() -> dict[str, Callable[..., StageManifest]]:
    """Each data stage's function, looked up when called (a test may stand in for one)."""
    from draftsmith.tasks import hidden_states, regenerate, select_prompts, tokenization

    return {
        "select_prompts": select_prompts.select_prompts,
        "regenerate": regenerate.regenerate,
        "tokenize": tokenization.tokenize,
        "hidden_states": hidden_states.capture_hidden_states,
    }


def run_data_stages(cfg: PipelineConfig, run: str, last: str = "hidden_states") -> dict[str, StageManifest]:
    """The data stages of `cfg` up to `last`, each in `<run>/<stage>` (cached ones are read, not rerun).
    `hidden_states` runs the offline capture (the online mode streams while training, with no store)."""
    if last not in DATA_STAGES:
        raise ValueError(f"last: {last!r} is not one of {DATA_STAGES}")
    functions = stage_functions()
    out: dict[str, Any] = {}
    for stage in DATA_STAGES[: DATA_STAGES.index(last) + 1]:
        out[stage] = functions[stage](**stage_arguments(cfg, stage, out), out_uri=storage.join(run, stage))
    return out
