"""The drafter registry: what the train and evaluate stages need from each drafter family.

A family is one adapter module, `drafters/<family>/family.py` (its functions are listed at `FAMILIES`).
Stages look the family up by `drafter.kind` and never branch on it. Imports are lazy so that choosing one
family never imports (or breaks on) another.

Shape legend: V target vocabulary, Ht target width, S sequence.
"""

import importlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from draftsmith.core.config import TargetConfig
from draftsmith.drafters.layers import RopeScaling


@dataclass(frozen=True)
class BuildInputs:
    """What building a drafter reads from the target and the corpus."""

    target: TargetConfig
    target_model: PreTrainedModel
    num_taps: int
    counts_V: torch.Tensor  # how often each target id is a loss token: the draft vocabulary's ranking


# kind -> its adapter module, which defines:
#   build(cfg, inputs) -> model                      a fresh drafter for the target
#   objective(cfg, model, head_VH, generator) -> Objective  its training objective; the trainer reseeds
#       `generator` before each micro-batch from that micro-batch's samples, so any rank draws alike
#   checkpoint_blobs(model, taps, metadata) -> {file: bytes}   the serving checkpoint
#   load(folder, target_model) -> (model, taps)      that checkpoint back, in fp32
#   generate(target, model, taps, prompt_S, *, g, max_new, eos, sampling, rule, generator, truncate) -> Decoded
#   proposer(model, g) -> Proposer                  one row's drafting state, for batched decoding
#   code_modules() -> [modules]                     whose source keys the train/evaluate caches
FAMILIES = {
    "eagle3": "draftsmith.drafters.eagle3.family",
    "dflash2": "draftsmith.drafters.dflash.family",
    "dspark": "draftsmith.drafters.dspark.family",
}


def family(kind: str) -> Any:
    """The adapter module of drafter family `kind`."""
    if kind not in FAMILIES:
        raise ValueError(f"drafter.kind: unknown drafter family {kind!r} (known: {', '.join(FAMILIES)})")
    return importlib.import_module(FAMILIES[kind])


# Shared by every family's build: the drafter must rotate and normalise exactly as its target does.


def rope_theta(config: PretrainedConfig) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta") or getattr(config, "rope_theta", 10000.0))


def rope_scaling(config: PretrainedConfig) -> dict | None:
    """The target's YaRN parameters (validated by `RopeScaling.from_config`), or None for plain RoPE."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    params.pop("rope_theta", None)
    if RopeScaling.from_config(params).rope_type == "default":
        return None
    return params


def rms_norm_eps(config: PretrainedConfig) -> float:
    return float(getattr(config, "rms_norm_eps", 1e-5))


def copy_frozen(dst: nn.Module | nn.Parameter, src: torch.Tensor) -> None:
    """Copy a target tensor into a drafter's frozen copy (embedding, shared lm_head), in fp32."""
    weight = dst.weight if isinstance(dst, nn.Module) else dst
    with torch.no_grad():
        weight.copy_(src.float())
    weight.requires_grad_(False)
