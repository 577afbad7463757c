"""Build the target engine a recipe's `regenerate` section asks for.

Backends import lazily: the HF engine pulls in torch and transformers, the vLLM one a GPU stack, and a
recipe using one should not need the others installed.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

from draftsmith.core.config import RegenerateConfig, TargetConfig
from draftsmith.core.target_setup import EMBEDDED_PREFIX, resolve_target
from draftsmith.engines.base import TargetEngine

_MODULES = {
    "hf": "draftsmith.engines.hf",
    "openai": "draftsmith.engines.openai_http",
    "vllm": "draftsmith.engines.vllm_offline",
}


def engine_module(cfg: RegenerateConfig) -> ModuleType:
    """The module implementing `cfg.engine` (its source is part of the stage's cache key)."""
    try:
        return importlib.import_module(_MODULES[cfg.engine])
    except ModuleNotFoundError as err:
        raise ValueError(f"regenerate.engine: {cfg.engine!r} is not available on this build ({err})") from err


def api_key(env: str | None) -> str | None:
    """The API key from the environment variable the recipe names; an unset or empty one is an error."""
    if env is None:
        return None
    value = os.environ.get(env, "")
    if not value:
        raise ValueError(f"regenerate.openai.api_key_env: environment variable {env} is not set")
    return value


def make_engine(cfg: RegenerateConfig, target: TargetConfig) -> TargetEngine:
    """A started engine for `cfg.engine`; call `close()` when done."""
    module = engine_module(cfg)
    if cfg.engine == "hf":
        return module.HFEngine(target, batch_size=cfg.batch_size)
    if cfg.engine == "openai":
        ep = cfg.openai
        if ep is None:  # the config validator guarantees it; kept for type narrowing
            raise ValueError("regenerate.openai: required when regenerate.engine is 'openai'")
        return module.OpenAIEngine(
            ep.base_url,
            ep.model,
            api_key=api_key(ep.api_key_env),
            concurrency=ep.concurrency,
            timeout_s=ep.timeout_s,
            max_retries=ep.max_retries,
            backoff_s=ep.backoff_s,
        )
    # vLLM loads a folder or a hub id; embedded targets are folders this project builds on demand.
    model = str(resolve_target(target.source)) if target.source.startswith(EMBEDDED_PREFIX) else target.source
    return module.VLLMOfflineEngine(
        model,
        max_model_len=cfg.vllm.max_model_len,
        seed=0,
        python=cfg.vllm.python,
        engine_kwargs=dict(cfg.vllm.engine_kwargs),
    )
