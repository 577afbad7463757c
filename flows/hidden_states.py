"""The `hidden-states` subflow: target hidden states of a tokenized corpus into the offline store.

The `kimi-k3` flow calls it after tokenization; deployed on its own (on a GPU pool) it picks up the
tokenize stage already finished under `run_dir`. In online mode with external producers it is the producer
side of the stream. Logic lives in `tasks/hidden_states.py` and `tasks/hidden_stream.py`.
"""

from prefect import flow

from draftsmith.core import storage
from draftsmith.core.config import PipelineConfig
from draftsmith.core.manifest import StageManifest
from draftsmith.tasks.hidden_states import finished_tokens, hidden_states_task
from draftsmith.tasks.hidden_stream import stream_hidden_states_task


@flow(name="hidden-states", flow_run_name="hidden-states[{config.name}]", log_prints=True, validate_parameters=True)
def hidden_states_flow(
    config: PipelineConfig, run_dir: str | None = None, tokens: StageManifest | None = None
) -> StageManifest | None:
    """Capture `config.hidden_states.taps` for every tokenized sample.

    Offline: into the store; returns its manifest. Online with external producers: streams them to the
    trainer waiting at `hidden_states.online.queue_addr`, once per training epoch; returns None.
    """
    run_dir = run_dir or storage.join(config.storage.run_root, config.name)
    tokens = tokens or finished_tokens(run_dir)
    if config.hidden_states.mode == "online":
        stream_hidden_states_task(config.hidden_states, config.target, tokens, config.train.epochs, config.name)
        return None
    return hidden_states_task(config.hidden_states, config.target, tokens, run_dir)
