"""The drafter registry: what the train, evaluate and export stages need from each drafter family.

A family is an object (usually its adapter module, `drafters/<family>/family.py`) that satisfies `Family`.
Stages, exports and evaluation look it up by `drafter.kind` and never branch on it. The built-in families
are listed by module name, so that choosing one never imports (or breaks on) another; a plugin
(`draftsmith.core.plugins`) adds its own with `register_family`, beside its config class
(`draftsmith.core.config.drafter.register_drafter`).

Shape legend: V target vocabulary, Ht target width, S sequence.
"""

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol, cast, runtime_checkable

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from draftsmith.core import plugins
from draftsmith.core.config import TargetConfig
from draftsmith.core.config.drafter import DrafterConfigBase
from draftsmith.drafters.layers import RopeScaling


@dataclass(frozen=True)
class BuildInputs:
    """What building a drafter reads from the target and the corpus."""

    target: TargetConfig
    target_model: PreTrainedModel
    num_taps: int
    counts_V: torch.Tensor  # how often each target id is a loss token: the draft vocabulary's ranking


@runtime_checkable
class Family(Protocol):
    """A drafter family, as the stages use it.

    `export` is its export module (`draftsmith.drafters.export.methods.ExportMethod`): the serving method, the
    engines' conventions and the files of an exported folder.
    """

    export: Any

    def build(self, cfg: DrafterConfigBase, inputs: BuildInputs) -> nn.Module:
        """A fresh drafter for the target."""

    def objective(self, cfg: DrafterConfigBase, model: nn.Module, head_VH: torch.Tensor, generator: torch.Generator):
        """Its training objective; the trainer reseeds `generator` before each micro-batch from that
        micro-batch's samples, so any rank draws alike."""

    def checkpoint_blobs(self, model: nn.Module, taps: list[int], metadata: dict) -> dict[str, bytes]:
        """The serving checkpoint: file name -> bytes."""

    def load(self, folder: str, target_model: PreTrainedModel) -> tuple[nn.Module, list[int]]:
        """That checkpoint back, in fp32, with its taps."""

    def generate(self, target, model, taps, prompt_S, *, g, max_new, eos, sampling, rule, generator, truncate):
        """Speculative decoding of one prompt (`draftsmith.drafters.speculative.Decoded`)."""

    def proposer(self, model: nn.Module, g: int) -> Any:
        """One row's drafting state, for batched decoding (`draftsmith.drafters.speculative_batch`)."""

    def code_modules(self) -> list[ModuleType]:
        """Modules whose source keys the train and evaluate caches."""


_BUILTIN = {
    "eagle3": "draftsmith.drafters.eagle3.family",
    "dflash2": "draftsmith.drafters.dflash.family",
    "dspark": "draftsmith.drafters.dspark.family",
}
_REGISTERED: dict[str, Family | Callable[[], Family]] = {}


def register_family(kind: str, family: Family | Callable[[], Family]) -> None:
    """Add drafter family `kind` (an object satisfying `Family`, or a function returning one on first use)."""
    if kind in _BUILTIN or _REGISTERED.get(kind, family) is not family:
        raise ValueError(f"drafter.kind: family {kind!r} is registered already")
    _REGISTERED[kind] = family


def kinds() -> tuple[str, ...]:
    """Every family: the built-in ones first, then the plugins'."""
    plugins.load()
    return (*_BUILTIN, *_REGISTERED)


def family(kind: str) -> Family:
    """The family of drafter kind `kind`."""
    if kind in _BUILTIN:
        return cast(Family, importlib.import_module(_BUILTIN[kind]))
    if kind not in kinds():
        raise ValueError(f"drafter.kind: unknown drafter family {kind!r} (known: {', '.join(kinds())})")
    found = _REGISTERED[kind]
    if not isinstance(found, Family):
        found = _REGISTERED[kind] = found()
    return found


def code_of(kind: str) -> list[ModuleType]:
    """The modules whose source keys a stage that runs family `kind`: the module defining it and its
    `code_modules()`."""
    found = family(kind)
    own = found if isinstance(found, ModuleType) else sys.modules[type(found).__module__]
    return [own, *found.code_modules()]


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
