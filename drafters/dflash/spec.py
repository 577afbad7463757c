"""The shapes and switches of a block drafter: DFlash, DFlash2 (conv + selector) and DSpark's backbone.

Layer attention follows vLLM's `_resolve_layer_attention` (`qwen3_dflash.py`): with `layer_types`, a
`sliding_attention` layer uses `sliding_window` and is causal inside the block, a `full_attention` layer is
bidirectional inside the block; without `layer_types` every layer is full and bidirectional.
"""

from dataclasses import asdict, dataclass

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class DFlashSpec:
    """Everything that fixes a block drafter's shapes (see the module docstring for the attention rules)."""

    hidden_size: int
    target_hidden_size: int
    num_taps: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    block_size: int = 8
    mask_token_id: int = 0
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    attention: str = "gqa"
    mla: dict | None = None
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rms_norm_eps: float = 1e-6
    fc_norm: bool = False
    draft_vocab_size: int | None = None
    conv_kernel_size: int = 0
    conv_group_size: int = 16
    selector_rank: int = 0
    selector_top_k: int = 16
    predict_anchor: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if self.block_size < 2:
            raise ValueError(f"dflash.block_size: must be at least 2, got {self.block_size}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"dflash.mask_token_id: {self.mask_token_id} is outside the vocabulary {self.vocab_size}")
        self._check_attention()
        self._check_dflash2()
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"dflash.draft_vocab_size: must be in [1, {self.vocab_size}], got {self.draft_vocab_size}")

    def _check_attention(self) -> None:
        if self.layer_types:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(
                    f"dflash.layer_types: {len(self.layer_types)} entries for num_layers={self.num_layers}"
                )
            bad = sorted(set(self.layer_types) - {FULL, SLIDING})
            if bad:
                raise ValueError(f"dflash.layer_types: unknown {bad} (expected {FULL!r} or {SLIDING!r})")
            if SLIDING in self.layer_types and (self.sliding_window is None or self.sliding_window < 1):
                raise ValueError("dflash.sliding_window: a positive window is required by sliding_attention layers")
        if self.attention not in ("gqa", "mla"):
            raise ValueError(f"dflash.attention: expected 'gqa' or 'mla', got {self.attention!r}")
        if self.attention == "mla" and not self.mla:
            raise ValueError("dflash.mla: attention 'mla' needs the MLA shapes (kv_lora_rank, qk_*_head_dim, ...)")
        if self.attention == "gqa" and self.num_heads % self.num_kv_heads:
            raise ValueError(f"dflash.num_heads: {self.num_heads} must divide by num_kv_heads {self.num_kv_heads}")

    def _check_dflash2(self) -> None:
        if self.conv_kernel_size < 0 or self.conv_kernel_size == 1:
            raise ValueError(f"dflash.conv_kernel_size: 0 (off) or at least 2, got {self.conv_kernel_size}")
        if self.conv_kernel_size and self.hidden_size % self.conv_group_size:
            raise ValueError(
                f"dflash.conv_group_size: {self.conv_group_size} must divide hidden_size {self.hidden_size}"
            )
        if self.selector_rank:
            if self.draft_vocab_size is not None:
                # vLLM's DFlash2 walk indexes the codebooks with lm_head ids and emits them as target ids.
                raise ValueError("dflash.selector_rank: the candidate selector needs the full vocabulary")
            if not 1 <= self.selector_top_k <= self.vocab_size:
                raise ValueError(f"dflash.selector_top_k: must be in [1, vocab_size], got {self.selector_top_k}")

    def layer_attention(self, i: int) -> tuple[int | None, bool]:
        """`(sliding_window or None, causal inside the block)` of layer `i`, as vLLM resolves them."""
        if not self.layer_types or self.layer_types[i] == FULL:
            return None, False
        return self.sliding_window, True

    @property
    def first_slot(self) -> int:
        """The first block slot that predicts a token: 0 for DSpark (`predict_anchor`), else 1."""
        return 0 if self.predict_anchor else 1

    def to_dict(self) -> dict:
        d = asdict(self)
        d["layer_types"] = list(self.layer_types)
        return d
