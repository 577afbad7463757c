"""The `drafter:` section: one model per drafter family, told apart by `kind`.

Every family's config extends `DrafterConfigBase` with `kind: Literal["<kind>"]` and registers itself
(`register_drafter`); the recipe's `drafter:` union, its YAML locations, the CLI's choices and the nightly
kinds all come from that one registry, so a family from a plugin (`draftsmith.core.plugins`) is a recipe
like any other. What the stages ask of a drafter beyond its shapes they ask through the methods below, never
by its kind.

`eagle3` is a chain drafter trained with training-time test (optionally anchored, optionally MLA attention);
`dflash2` and `dspark` are block drafters that draft a whole block in one forward. Every family's width is
the target's (`target.hidden_size`): drafters share the target's embedding, and the block drafters its lm_head.
Cross-section checks (taps, vocabulary, widths) live in `draftsmith.core.config.pipeline`.
"""

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, Union

from pydantic import Field, ValidationInfo, field_validator, model_validator

from draftsmith.core import plugins
from draftsmith.core.config.base import StrictModel

if TYPE_CHECKING:
    from draftsmith.core.config.stages import TargetConfig

LayerType = Literal["full_attention", "sliding_attention"]


class MLAConfig(StrictModel):
    """Multi-head latent attention shapes (DeepSeek-V3 / Kimi naming)."""

    kv_lora_rank: int = Field(gt=0, description="Rank of the compressed key/value latent.")
    q_lora_rank: int | None = Field(None, gt=0, description="Rank of the query bottleneck; null: a plain q_proj.")
    qk_nope_head_dim: int = Field(gt=0, description="Per-head query/key width without RoPE.")
    qk_rope_head_dim: int = Field(gt=0, description="Per-head decoupled RoPE width (one rotary key shared by heads).")
    v_head_dim: int = Field(gt=0, description="Per-head value width.")

    @field_validator("qk_rope_head_dim")
    @classmethod
    def _even(cls, v: int) -> int:
        if v % 2:
            raise ValueError(f"qk_rope_head_dim ({v}) must be even: RoPE rotates pairs")
        return v


class AnchorConfig(StrictModel):
    """Anchored TTT: run the chain only at sampled anchors, so a step's cost stops growing with length."""

    num_anchors: int = Field(gt=0, description="Anchor slots per sequence (fixed, with a keep mask).")
    max_gap: int = Field(0, ge=0, description="At most this many candidates between consecutive anchors.")


class DrafterConfigBase(StrictModel):
    """The `drafter:` section of every family: its kind, and what the stages ask of it."""

    kind: str = Field(description="Drafter family.")
    draft_vocab_size: int | None = Field(None, gt=0, description="Draft vocabulary size; null: the target's.")

    def drafts_per_round(self, num_draft_tokens: int) -> int:
        """Tokens drafted per verification round when evaluating with `evaluate.num_draft_tokens`."""
        raise NotImplementedError(f"drafter {self.kind!r}: drafts_per_round")

    @property
    def trained_depth(self) -> int | None:
        """A chain drafter's trained depth (what a serving engine drafts by default); None for others."""
        return None

    def serving_tokens(self, num_draft_tokens: int) -> int | None:
        """Draft tokens per step a serving engine must be told for this drafter; None: its export says."""
        return None

    def serving_depths(self, requested: tuple[int, ...] | None, num_draft_tokens: int) -> list[int | None]:
        """Draft tokens per step each speculating server is told (`speedup.draft_tokens`, default the
        evaluation's `num_draft_tokens`); [None] for a drafter whose export fixes them, which takes none."""
        if self.serving_tokens(num_draft_tokens) is None:
            if requested is not None:
                raise ValueError(f"draft_tokens: a {self.kind} drafter drafts the block its export fixes; leave it out")
            return [None]
        return [self.serving_tokens(d) for d in requested or (num_draft_tokens,)]

    def calibration_prompts(self, requested: int) -> int:
        """Prompts of the confidence calibration pass the evaluation runs (`evaluate.calibration_prompts`)."""
        return 0

    def target_modules(self, num_layers: int) -> list[str]:
        """Target modules (HF names) whose weights building this drafter copies, besides embedding and head."""
        return []

    def check_target(self, target: "TargetConfig") -> None:
        """Raise a ValueError naming the field when this drafter does not fit `target`."""
        if self.draft_vocab_size is not None and self.draft_vocab_size > target.vocab_size:
            raise ValueError(
                f"drafter.draft_vocab_size: {self.draft_vocab_size} exceeds target.vocab_size ({target.vocab_size})"
            )

    def describe(self) -> str:
        """One line on the drafter for `draftsmith plan`."""
        return self.kind


class _AttentionFields(DrafterConfigBase):
    num_heads: int = Field(gt=0, description="Attention heads per draft layer.")
    num_kv_heads: int = Field(gt=0, description="Key/value heads (GQA); ignored by MLA layers.")
    head_dim: int = Field(gt=0, description="Per-head width of GQA layers.")
    intermediate_size: int = Field(gt=0, description="SwiGLU MLP width.")
    attention: Literal["gqa", "mla"] = Field("gqa", description="Attention kind of the draft layers.")
    mla: MLAConfig | None = Field(None, description="MLA shapes; required when attention is mla.")
    fc_norm: bool = Field(False, description="RMSNorm each target tap before the fc fusion (EAGLE-3.1, K3 configs).")

    @field_validator("num_kv_heads")
    @classmethod
    def _kv_divides_heads(cls, kv: int, info: ValidationInfo) -> int:
        heads = info.data.get("num_heads")
        if heads is not None and heads % kv != 0:
            raise ValueError(f"num_kv_heads ({kv}) must divide num_heads ({heads})")
        return kv

    @model_validator(mode="after")
    def _mla_shapes(self):
        if self.attention == "mla" and self.mla is None:
            raise ValueError("mla: required when attention is 'mla'")
        if self.attention == "gqa" and self.mla is not None:
            raise ValueError("mla: given but attention is 'gqa'; set attention: mla or drop the block")
        return self


class Eagle3Config(_AttentionFields):
    """EAGLE-3 / EAGLE-3.1: one decoder layer over fused taps, a pruned vocabulary, training-time test."""

    kind: Literal["eagle3"] = Field("eagle3", description="Drafter family.")
    draft_vocab_size: int = Field(gt=0, description="Draft vocabulary: the most frequent loss tokens.")
    ttt_depth: int = Field(3, ge=1, le=16, description="Training-time-test depth (chain length trained).")
    depth_decay: float = Field(0.8, gt=0.0, le=1.0, description="Loss weight of depth k is decay**k.")
    norm_output: bool = Field(False, description="EAGLE-3.1: feed norm(h) to the next depth.")
    feature_noise: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Training only: add U(-x, x) times each tap's RMS to the target features a step reads "
        "(EAGLE's feature augmentation, relative to the tap's scale); 0: off.",
    )
    anchored: AnchorConfig | None = Field(None, description="Anchored TTT; null: dense TTT at every position.")
    init_lm_head_from_target: bool = Field(
        True, description="Start the draft lm_head from the target's rows (faster convergence)."
    )
    freeze_lm_head: bool = Field(
        False,
        description="Keep the draft lm_head at its initial rows (the target's, with init_lm_head_from_target): "
        "a step skips the head's weight gradient and optimizer update (docs/training.md: its effect on quality).",
    )

    init_layer_from_target: int | None = Field(
        None,
        description="Start the draft layer from this target decoder layer (negative counts from the end; its "
        "q/k/v on both input halves, MLP, norms) and the output norm from the target's; null: random (GQA only).",
    )
    init_fc_last_tap: bool = Field(
        False,
        description="With init_layer_from_target: start the tap fusion as the identity on the last tap.",
    )

    @model_validator(mode="after")
    def _target_init(self):
        if self.init_fc_last_tap and self.init_layer_from_target is None:
            raise ValueError("init_fc_last_tap: needs init_layer_from_target")
        if self.init_layer_from_target is not None and self.attention != "gqa":
            raise ValueError("init_layer_from_target: only GQA draft layers can start from a target layer")
        return self

    def target_modules(self, num_layers: int) -> list[str]:
        if self.init_layer_from_target is None:
            return []
        return [f"model.layers.{self.init_layer_from_target % num_layers}", "model.norm"]

    def check_target(self, target: "TargetConfig") -> None:
        super().check_target(target)
        n, i = target.num_layers, self.init_layer_from_target
        if i is not None and not -n <= i < n:
            raise ValueError(f"drafter.init_layer_from_target: {i} is not a layer of the {n}-layer target")

    def drafts_per_round(self, num_draft_tokens: int) -> int:
        """A chain drafts as many tokens per round as the evaluation asks (`evaluate.num_draft_tokens`)."""
        return num_draft_tokens

    @property
    def trained_depth(self) -> int | None:
        return self.ttt_depth

    def serving_tokens(self, num_draft_tokens: int) -> int | None:
        # A chain's depth is a serving choice the engine needs spelled out; the evaluation's is the default.
        return num_draft_tokens

    def describe(self) -> str:
        how = f"anchored TTT ({self.anchored.num_anchors} anchors)" if self.anchored else "dense TTT"
        return f"eagle3 (1 layer, {_attention(self)}, {how} depth {self.ttt_depth}, {_vocab(self)})"


class _BlockFields(_AttentionFields):
    num_layers: int = Field(5, gt=0, description="Draft decoder layers.")
    block_size: int = Field(8, ge=2, le=64, description="Block length B: the anchor plus B-1 mask slots.")
    mask_token_id: int = Field(ge=0, description="Token id fed to the mask slots; pick one the corpus never uses.")
    layer_types: list[LayerType] | None = Field(None, description="Per-layer attention type; null: all full_attention.")
    sliding_window: int | None = Field(None, gt=0, description="Window of sliding_attention layers, in tokens.")
    num_anchors: int = Field(64, gt=0, description="Blocks sampled per sequence per step (fixed slots, keep mask).")
    draft_vocab_size: int | None = Field(
        None, gt=0, description="Own pruned lm_head of this size (with d2t/t2d); null: the target's frozen lm_head."
    )

    def check_target(self, target: "TargetConfig") -> None:
        super().check_target(target)
        if self.mask_token_id >= target.vocab_size:
            raise ValueError(
                f"drafter.mask_token_id: {self.mask_token_id} is outside target.vocab_size ({target.vocab_size})"
            )

    def describe(self) -> str:
        types = self.layer_types or ["full_attention"] * self.num_layers
        sliding = sum(t == "sliding_attention" for t in types)
        layers = f"{self.num_layers} layers" + (f" ({sliding} sliding-window {self.sliding_window})" if sliding else "")
        return (
            f"{self.kind} ({layers}, {_attention(self)}, block {self.block_size}, {self.num_anchors} anchors/seq, "
            f"{self._heads()}, {_vocab(self)})"
        )

    def _heads(self) -> str:
        return ""

    @model_validator(mode="after")
    def _layers(self):
        types = self.layer_types
        if types is not None and len(types) != self.num_layers:
            raise ValueError(f"layer_types: {len(types)} entries for num_layers {self.num_layers}")
        if types and "sliding_attention" in types and self.sliding_window is None:
            raise ValueError("sliding_window: required when layer_types has sliding_attention layers")
        return self


class DFlash2Config(_BlockFields):
    """DFlash2: the DFlash block drafter plus the dynamic depthwise conv and the top-K path selector."""

    kind: Literal["dflash2"] = Field("dflash2", description="Drafter family.")
    gamma: float = Field(4.0, gt=0.0, description="Slot k (k >= 1) is weighted exp(-(k-1)/gamma); 4 for B = 8.")
    conv_kernel_size: int = Field(2, ge=0, le=4, description="Dynamic depthwise conv taps; 0 turns it off.")
    conv_group_size: int = Field(16, gt=0, description="Channels per content-adaptive conv group.")
    selector_rank: int = Field(256, ge=0, description="Candidate selector codebook rank; 0 turns it off.")
    selector_top_k: int = Field(16, ge=2, description="Candidates kept per slot for the path selector.")
    selector_alpha: float = Field(0.1, ge=0.0, description="Weight of the selector's K-way CE in the loss.")

    def drafts_per_round(self, num_draft_tokens: int) -> int:
        """The mask slots: the anchor slot holds the verified token and predicts nothing."""
        return self.block_size - 1

    def check_target(self, target: "TargetConfig") -> None:
        super().check_target(target)
        if self.conv_kernel_size and target.hidden_size % self.conv_group_size:
            raise ValueError(
                f"drafter.conv_group_size: {self.conv_group_size} must divide target.hidden_size ({target.hidden_size})"
            )
        if self.selector_rank and self.draft_vocab_size is not None:
            # vLLM's DFlash2 walk indexes the selector codebooks with lm_head ids and emits them as target ids.
            raise ValueError(
                "drafter.draft_vocab_size: the DFlash2 candidate selector needs the full vocabulary "
                "(set draft_vocab_size: null, or selector_rank: 0)"
            )
        if self.selector_rank and self.selector_top_k > (self.draft_vocab_size or target.vocab_size):
            raise ValueError("drafter.selector_top_k: more candidates than the drafter's vocabulary")

    def _heads(self) -> str:
        return f"conv {self.conv_kernel_size}, selector rank {self.selector_rank} top-{self.selector_top_k}"


class DSparkConfig(_BlockFields):
    """DSpark: a block drafter whose anchor slot predicts too, with a Markov head and a confidence head."""

    kind: Literal["dspark"] = Field("dspark", description="Drafter family.")
    block_size: int = Field(7, ge=2, le=64, description="Block length B; every slot predicts, so B drafts a round.")
    gamma: float = Field(4.0, gt=0.0, description="Slot k (from 0) is weighted exp(-k/gamma).")
    markov_rank: int = Field(256, gt=0, description="Rank of the low-rank Markov (previous-token) head.")
    confidence_head: bool = Field(True, description="Train the per-slot acceptance-confidence head.")
    loss_weights: tuple[float, float, float] = Field(
        (0.1, 0.9, 1.0), description="Weights of (CE, L1 to the target distribution, confidence BCE)."
    )
    partial_blocks: bool = Field(
        True,
        description="Anchor blocks up to the last supervised position, supervising only the slots inside the "
        "row (DeepSpec's sampler); false keeps anchors block_size + 1 tokens clear of the row end, so every block "
        "is whole and the last tokens of a row are learnt only at late slots.",
    )
    target_vocab: Literal["full", "draft"] = Field(
        "full",
        description="Target distribution of the L1 term and the confidence target with a pruned draft vocabulary: "
        "`full` is the target's softmax over its whole vocabulary (mass outside the draft ids counts as missed, "
        "as in the paper); `draft` renormalises it over the draft ids (optimistic by that mass). The same "
        "without pruning.",
    )
    init_std: float | None = Field(
        0.02,
        gt=0.0,
        description="Trained weights (Markov and confidence heads included) start N(0, init_std), biases 0, "
        "norms 1 (DeepSpec's Hugging Face init); null: torch's default init with markov_w1 N(0, 1) and "
        "markov_w2 zeros.",
    )

    def drafts_per_round(self, num_draft_tokens: int) -> int:
        """Every slot predicts, the anchor's included."""
        return self.block_size

    def calibration_prompts(self, requested: int) -> int:
        return requested  # the confidence head is calibrated on prompts of its own

    def _heads(self) -> str:
        return f"Markov rank {self.markov_rank}, confidence head {'on' if self.confidence_head else 'off'}"


def _attention(d: _AttentionFields) -> str:
    return f"{d.attention} attention" + (" + fc_norm" if d.fc_norm else "")


def _vocab(d: DrafterConfigBase) -> str:
    return f"draft vocab {d.draft_vocab_size}" if d.draft_vocab_size else "target lm_head (frozen)"


# --- the registry ---------------------------------------------------------------------------------------

_REGISTRY: dict[str, type[DrafterConfigBase]] = {}
_on_register: list[Callable[[], None]] = []


def register_drafter(cls: type[DrafterConfigBase]) -> type[DrafterConfigBase]:
    """Add a family's config class (its `kind` default names it); models holding a `drafter:` rebuild."""
    kind = cls.model_fields["kind"].default
    if not isinstance(kind, str) or not kind or not issubclass(cls, DrafterConfigBase):
        raise TypeError(f"{cls.__name__}: a drafter config extends DrafterConfigBase with a default `kind`")
    if _REGISTRY.get(kind, cls) is not cls:
        raise ValueError(f"drafter.kind: {kind!r} is registered already ({_REGISTRY[kind].__name__})")
    _REGISTRY[kind] = cls
    for rebuild in _on_register:
        rebuild()
    return cls


def on_register(rebuild: Callable[[], None]) -> None:
    """Call `rebuild` after each registration (a model whose field is `drafter_union()`)."""
    _on_register.append(rebuild)


def drafter_kinds() -> tuple[str, ...]:
    """Every registered kind: the built-in families first, then the plugins'."""
    plugins.load()
    return tuple(_REGISTRY)


def drafter_union() -> Any:
    """The union of every registered config class, told apart by `kind` (a typing form, not a class)."""
    return Union[tuple(_REGISTRY.values())]  # noqa: UP007 - built from a runtime tuple


def parse_drafter(data: dict) -> DrafterConfigBase:
    """A `drafter:` section (for example from a job spec) as its family's config."""
    kind = data.get("kind") if isinstance(data, dict) else None
    if kind not in drafter_kinds():
        raise ValueError(f"drafter.kind: unknown drafter family {kind!r} (known: {', '.join(drafter_kinds())})")
    return _REGISTRY[kind].model_validate(data)


for _cls in (Eagle3Config, DFlash2Config, DSparkConfig):
    register_drafter(_cls)
BUILTIN_KINDS = tuple(_REGISTRY)  # the project's own families, before any plugin's

# The annotation for code that takes any family's config.
DrafterConfig = DrafterConfigBase
