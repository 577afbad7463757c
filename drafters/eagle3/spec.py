"""The shapes of an EAGLE-3 drafter (`Eagle3Spec`) and the attention choices they allow."""

from dataclasses import asdict, dataclass

ATTENTIONS = ("gqa", "mla")
MLA_KEYS = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
MLA_REQUIRED = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def check_attention(attention: str, mla: dict | None) -> None:
    """Raise a ValueError naming the field when `attention`/`mla` of an Eagle3Spec do not fit together."""
    if attention not in ATTENTIONS:
        raise ValueError(f"Eagle3Spec.attention: {attention!r} is not one of {ATTENTIONS}")
    if attention == "gqa":
        if mla is not None:
            raise ValueError("Eagle3Spec.mla: given but attention is 'gqa'")
        return
    if mla is None:
        raise ValueError("Eagle3Spec.mla: required when attention is 'mla'")
    unknown = sorted(set(mla) - set(MLA_KEYS))
    missing = [k for k in MLA_REQUIRED if k not in mla]
    if unknown or missing:
        raise ValueError(f"Eagle3Spec.mla: unknown keys {unknown}, missing keys {missing} (allowed: {MLA_KEYS})")
    if mla["qk_rope_head_dim"] % 2:
        raise ValueError(f"Eagle3Spec.mla.qk_rope_head_dim: {mla['qk_rope_head_dim']} must be even")


@dataclass(frozen=True)
class Eagle3Spec:
    """Everything that fixes the drafter's shapes."""

    hidden_size: int
    target_hidden_size: int
    num_taps: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    draft_vocab_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    fc_norm: bool = False
    norm_output: bool = False
    rope_scaling: dict | None = None  # the target's YaRN parameters (`draftsmith.drafters.layers.RopeScaling`), if any
    attention: str = "gqa"  # "gqa" | "mla"; with "mla", num_kv_heads and head_dim are unused
    mla: dict | None = (
        None  # `draftsmith.drafters.mla.MLASpec` shapes: kv_lora_rank, q_lora_rank, qk_nope/qk_rope/v_head_dim
    )

    def __post_init__(self) -> None:
        check_attention(self.attention, self.mla)

    def to_dict(self) -> dict:
        return asdict(self)
