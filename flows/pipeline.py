"""The `kimi-k3` flow: the six stages chained. Logic lives in `tasks/`; this file only wires it."""

from prefect import flow

from draftsmith import storage
from draftsmith.config import PipelineConfig, record_recipe
from draftsmith.manifest import StageManifest
from flows.hidden_states import hidden_states_flow
from tasks.evaluate import evaluate_task
from tasks.regenerate import regenerate_task
from tasks.select_prompts import select_prompts_task
from tasks.tokenization import tokenize_task
from tasks.train import train_task


def default_run_dir(config: PipelineConfig) -> str:
    return storage.join(config.storage.run_root, config.name)


@flow(name="kimi-k3", flow_run_name="{config.name}", log_prints=True, validate_parameters=True)
def kimi_k3(config: PipelineConfig, run_dir: str | None = None) -> dict[str, StageManifest | None]:
    """Select prompts, regenerate, tokenize, capture hidden states, train and evaluate a drafter."""
    run_dir = run_dir or default_run_dir(config)
    record_recipe(config, run_dir)
    prompts = select_prompts_task(config.select, config.target, config.seed, run_dir)
    conversations = regenerate_task(config.regenerate, config.target, prompts, config.seed, run_dir)
    tokens = tokenize_task(config.tokenize, config.target, conversations, run_dir)
    # Online, the training stage consumes the stream while its producers capture; nothing is stored.
    hidden = hidden_states_flow(config, run_dir, tokens) if config.hidden_states.mode == "offline" else None
    checkpoint = train_task(
        config.train, config.drafter, config.target, config.hidden_states, tokens, hidden, config.seed, run_dir
    )
    results = evaluate_task(config.evaluate, config.drafter, config.target, prompts, checkpoint, run_dir, config.seed)
    return {
        "select_prompts": prompts,
        "regenerate": conversations,
        "tokenize": tokens,
        "hidden_states": hidden,
        "train": checkpoint,
        "evaluate": results,
    }
