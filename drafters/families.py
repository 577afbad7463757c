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
from draftsmith.drafters.layers import RopeScaling


@dataclass(frozen=True)
class BuildInputs:
    """What building a drafter reads from the target and the corpus."""

    target: TargetConfig
    target_model: PreTrainedModel
    num_taps: int
    counts_V: torch.Tensor  # how often each target id is a loss token: the draft vocabulary's ranking


class ExportMethod(Protocol):
    """A serving method: what an engine calls a drafter and that method's conventions, as the export, serve and
    sweep code use it (`draftsmith.drafters.export.methods`). Usually a family's `export` module; several
    families may share one. Drafters are typed `Any` here: each method takes its own family's drafter class.
    A method may also define `check_servable(spec, engine)`, run before its checkpoint is written."""

    METHOD: str  # the name the engines know (vLLM's `--speculative-config` method)
    SGLANG_ALGORITHM: str  # SGLang's and TokenSpeed's name for it
    TAP_IDS_ENGINES: tuple[str, ...]  # engines whose draft config lists our taps as they are (the others: tap - 1)

    def draft_tokens(self, *, depth: int | None = None, block_size: int | None = None) -> int:
        """Drafts per verification step of a drafter trained with `depth` (EAGLE-3) or `block_size` (blocks)."""
        ...

    def num_speculative_tokens(self, config: dict, depth: int | None) -> int:
        """Drafts per verification step of an exported `config.json` (`depth` overrides its own)."""
        ...

    def speculative_args(self, engine: str, num_tokens: int) -> list[str]:
        """The method's own launch flags for SGLang and TokenSpeed."""
        ...

    def notes(self, engine: str) -> list[str]:
        """Caveats printed with the launch command."""
        ...

    def recognizes(self, config: dict) -> bool:
        """Whether an exported `config.json` is this method's."""
        ...

    def checkpoint_blobs(self, model: Any, taps: list[int], metadata: dict, engine: str = ...) -> dict[str, bytes]:
        """The serving checkpoint for `engine`: file name -> bytes."""
        ...

    def config_layer_ids(self, config: dict) -> list[int]:
        """The tap layer ids an exported `config.json` lists."""
        ...

    def expected_shapes(self, config: dict) -> dict[str, tuple[int, ...]]:
        """Every weight's shape as an exported `config.json` implies it."""
        ...

    def extra_files(self, blobs: dict[str, bytes], run_dir: str, model: Any) -> dict[str, bytes]:
        """Files beyond the weights (e.g. a calibration), from the run folder."""
        ...

    def load_drafter(
        self, folder: str, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor | None = None
    ) -> tuple[Any, list[int]]:
        """The fp32 drafter and its taps from an exported folder, sharing the target's embedding (and head)."""
        ...


@runtime_checkable
class Family(Protocol):
    """A drafter family, as the stages use it.

    `export` is its serving method (`ExportMethod`, usually the family's export module): the method's name, the
    engines' conventions and the files of an exported folder. Configs and drafters are typed `Any`: each family
    takes its own config class (found by `drafter.kind`) and its own drafter class.
    """

    @property
    def export(self) -> ExportMethod: ...

    def build(self, cfg: Any, inputs: BuildInputs) -> nn.Module:
        """A fresh drafter for the target."""

    def objective(self, cfg: Any, model: Any, head_VH: torch.Tensor, generator: torch.Generator):
        """Its training objective; the trainer reseeds `generator` before each micro-batch from that
        micro-batch's samples, so any rank draws alike."""

    def checkpoint_blobs(self, model: Any, taps: list[int], metadata: dict) -> dict[str, bytes]:
        """The serving checkpoint: file name -> bytes."""

    def load(self, folder: str, target_model: PreTrainedModel) -> tuple[nn.Module, list[int]]:
        """That checkpoint back, in fp32, with its taps."""

    def generate(self, target, model, taps, prompt_S, *, g, max_new, eos, sampling, rule, generator, truncate):
        """Speculative decoding of one prompt (`draftsmith.drafters.speculative.Decoded`)."""

    def proposer(self, model: Any, g: int) -> Any:
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
    return float(params.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0)


def rope_scaling(config: PretrainedConfig) -> dict | None:
    """The target's YaRN parameters (validated by `RopeScaling.from_config`), or None for plain RoPE."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    params.pop("rope_theta", None)
    if RopeScaling.from_config(params).rope_type == "default":
        return None
    return params


def rms_norm_eps(config: PretrainedConfig) -> float:
    return float(getattr(config, "rms_norm_eps", 1e-5))


def weight_of(module: nn.Module) -> torch.Tensor:
    """`module.weight` (an embedding's, a linear head's) as a tensor; module attributes type as `Tensor | Module`."""
    weight = module.weight
    assert isinstance(weight, torch.Tensor), type(weight)
    return weight


def copy_frozen(dst: nn.Module | nn.Parameter, src: torch.Tensor) -> None:
    """Copy a target tensor into a drafter's frozen copy (embedding, shared lm_head), in fp32."""
    weight = weight_of(dst) if isinstance(dst, nn.Module) else dst
    with torch.no_grad():
        weight.copy_(src.float())
    weight.requires_grad_(False)
