"""The speculation an engine gives for free, as vLLM flags: n-gram prompt lookup and suffix decoding.

Neither needs a trained model, so a trained drafter has to beat them to earn its place. vLLM (0.32,
`vllm/config/speculative.py`) runs `ngram` everywhere; `suffix` needs the Arctic Inference package in the
serving environment (`arctic_inference.suffix_decoding`), which `make` installs into `.venv-vllm`.
"""

from __future__ import annotations

import json
import subprocess

from draftsmith.core.config.sweep import NgramSettings, SpeedupConfig, SuffixSettings

# What each method imports in the serving environment; a failed import is the reason it is skipped.
_NEEDS = {"suffix": "arctic_inference.suffix_decoding"}


def speculative_config(method: str, cfg: SpeedupConfig) -> dict:
    """vLLM's `--speculative-config` for a free method, from the recipe's settings."""
    if method == "ngram":
        return _ngram(cfg.ngram)
    if method == "suffix":
        return _suffix(cfg.suffix)
    raise ValueError(f"free method {method!r}: expected ngram or suffix")


def _ngram(s: NgramSettings) -> dict:
    return {
        "method": "ngram",
        "num_speculative_tokens": s.num_speculative_tokens,
        "prompt_lookup_min": s.prompt_lookup_min,
        "prompt_lookup_max": s.prompt_lookup_max,
    }


def _suffix(s: SuffixSettings) -> dict:
    config: dict = {"method": "suffix"}
    if s.num_speculative_tokens is not None:
        config["num_speculative_tokens"] = s.num_speculative_tokens
    if s.max_cached_requests is not None:
        config["suffix_decoding_max_cached_requests"] = s.max_cached_requests
    return config


def server_args(method: str, cfg: SpeedupConfig) -> list[str]:
    return ["--speculative-config", json.dumps(speculative_config(method, cfg))]


def unavailable(method: str, python: str) -> str | None:
    """Why `python`'s vLLM environment cannot serve `method`, or None when it can."""
    module = _NEEDS.get(method)
    if module is None:
        return None
    probe = subprocess.run([python, "-c", f"import {module}"], capture_output=True, text=True, timeout=120)
    if probe.returncode == 0:
        return None
    last = (probe.stderr.strip().splitlines() or ["import failed"])[-1]
    return f"{method} decoding needs {module.split('.')[0]} in the vLLM environment ({last})"
