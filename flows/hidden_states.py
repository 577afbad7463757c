"""The `hidden-states` subflow: target hidden states of a tokenized corpus into the offline store.

The `kimi-k3` flow calls it after tokenization; deployed on its own (on a GPU pool) it picks up the
tokenize stage already finished under `run_dir`. Logic lives in `tasks/hidden_states.py`.
"""

from prefect import flow

from draftsmith import storage
from draftsmith.config import PipelineConfig
from draftsmith.manifest import StageManifest
from tasks.hidden_states import finished_tokens, hidden_states_task


@flow(name="hidden-states", flow_run_name="{config.name}-hidden-states", log_prints=True, validate_parameters=True)
def hidden_states_flow(
    config: PipelineConfig, run_dir: str | None = None, tokens: StageManifest | None = None
) -> StageManifest:
    """Capture `config.hidden_states.taps` for every tokenized sample; returns the store's manifest."""
    run_dir = run_dir or storage.join(config.storage.run_root, config.name)
    tokens = tokens or finished_tokens(run_dir)
    return hidden_states_task(config.hidden_states, config.target, tokens, run_dir)
