"""Layers shared by the drafters: RMSNorm, the output head, rotary embeddings (plain and YaRN), SwiGLU MLP.

Shape legend: B batch, S sequence, D model width, h heads, d head width, n rows, V output vocabulary.
"""

import math
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from draftsmith.kernels import HeadLossOut, Target, head_loss, rms_norm


class RMSNorm(nn.Module):
    """Llama RMSNorm, computed in fp32 whatever the storage dtype."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Under torch.compile the reference is traced and fused by inductor; eager runs dispatch (`kernels`).
        return rms_norm(x, self.weight, self.eps, mode="reference" if torch.compiler.is_compiling() else None)


def multi_rms_norm(norms: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    """`cat([norm_i(chunk_i(x))])` `[..., n*H]` in one pass: EAGLE-3.1 / DSpark's per-tap `fc_norm`."""
    rms = cast(list[RMSNorm], list(norms))  # a ModuleList iterates as Module
    weight_nH = torch.stack([norm.weight for norm in rms])
    mode = "reference" if torch.compiler.is_compiling() else None
    return rms_norm(x, weight_nH, rms[0].eps, mode=mode)


@dataclass(frozen=True)
class HeadLossCall:
    """Keyword arguments of `draftsmith.kernels.head_loss` besides the rows and the weight. A dataclass, not a dict, so
    that FSDP's forward-input cast leaves the fp32 row weights alone (see `draftsmith.kernels.head_loss.head_loss`)."""

    target: Target | None = None
    labels: torch.Tensor | None = None
    w_soft: torch.Tensor | None = None
    w_ce: torch.Tensor | None = None
    w_l1: torch.Tensor | None = None
    extra: tuple[torch.Tensor, torch.Tensor] | None = None


class OutputHead(nn.Linear):
    """The lm_head (`Linear(D, V, bias=False)`, same weights and keys) that can also compute the fused head
    loss without materialising `[n, V]` logits. FSDP registers `fused_loss` (the head is its own unit), so the
    weight is gathered for it as for `forward`."""

    fsdp_forward_methods: tuple[str, ...] = ("fused_loss",)

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)

    def fused_loss(self, x_nD: torch.Tensor, call: HeadLossCall) -> HeadLossOut:
        """`draftsmith.kernels.head_loss(x, self.weight, ...)` on rows `[n, D]` (already through the final norm)."""
        return apply_head_loss(x_nD, self.weight, call)


def apply_head_loss(x_nD: torch.Tensor, weight_VD: torch.Tensor, call: HeadLossCall) -> HeadLossOut:
    """`draftsmith.kernels.head_loss` of rows `[n, D]` against `weight_VD` `[V, D]` with the terms `call` names."""
    return head_loss(
        x_nD,
        weight_VD,
        target=call.target,
        labels=call.labels,
        w_soft=call.w_soft,
        w_ce=call.w_ce,
        w_l1=call.w_l1,
        extra=call.extra,
    )


class SwiGLU(nn.Module):
    """`down(silu(gate(x)) * up(x))`, the Llama MLP."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


@dataclass(frozen=True)
class RopeScaling:
    """A target's `rope_parameters` / `rope_scaling`: `default` (plain RoPE) or `yarn` (DeepSeek/Kimi long context).

    YaRN (arXiv 2309.00071) keeps high-frequency dims as trained (extrapolation), divides low-frequency dims'
    frequencies by `factor` (interpolation), ramps linearly between the dims that make `beta_fast` and
    `beta_slow` rotations over `original_max_position_embeddings`, and scales cos/sin by an attention factor
    (`0.1 * mscale * ln(factor) + 1`, or the ratio of two such terms when `mscale_all_dim` is set, as
    DeepSeek-V3 and Kimi configs do). A drafter must rotate exactly as its target does, or its attention over
    target positions is off at every distance the ramp touches.
    """

    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    @classmethod
    def from_config(cls, params: dict | None) -> "RopeScaling":
        """From an HF config's `rope_parameters` (or legacy `rope_scaling`); unknown types are an error."""
        params = dict(params or {})
        kind = params.pop("rope_type", params.pop("type", "default"))
        if kind not in ("default", "yarn"):
            raise ValueError(f"rope_parameters.rope_type: {kind!r} is not supported (default, yarn)")
        if kind == "default":
            return cls()
        fields = {k: params[k] for k in cls.__dataclass_fields__ if k in params and k != "rope_type"}
        return cls(rope_type="yarn", **fields)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(
    head_dim: int, theta: float, s: RopeScaling, device: torch.device | None = None
) -> tuple[torch.Tensor, float]:
    """YaRN's blended inverse frequencies `[d/2]` (on `device`) and its cos/sin scale."""
    if s.original_max_position_embeddings is None:
        raise ValueError("rope_parameters.original_max_position_embeddings: required for yarn")
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (s.factor * pos_freqs)

    original = s.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (high frequency), 0: interpolate
    inv_freq = interpolation * (1 - keep) + extrapolation * keep
    if s.attention_factor is not None:
        att = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        att = _yarn_mscale(s.factor, s.mscale) / _yarn_mscale(s.factor, s.mscale_all_dim)
    else:
        att = _yarn_mscale(s.factor)
    return inv_freq, float(att)


def rope_tables(
    positions: torch.Tensor, head_dim: int, theta: float, scaling: RopeScaling | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin `[..., d]` for integer `positions` `[...]` (Llama's half-split layout), YaRN-scaled if asked."""
    # The frequencies are made where the positions live: a CPU table would meet accelerator positions.
    device = positions.device
    if scaling is None or scaling.rope_type == "default":
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
        att = 1.0
    else:
        inv_freq, att = _yarn_inv_freq(head_dim, theta, scaling, device)
    angles = positions.float()[..., None] * inv_freq
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos() * att, emb.sin() * att


def apply_rope(x_BhSd: torch.Tensor, cos_BSd: torch.Tensor, sin_BSd: torch.Tensor) -> torch.Tensor:
    """Rotate `[B, h, S, d]` by tables broadcastable to `[B, 1, S, d]`."""
    half = x_BhSd.shape[-1] // 2
    rotated = torch.cat([-x_BhSd[..., half:], x_BhSd[..., :half]], dim=-1)
    # The tables are fp32; the result keeps x's dtype so bf16 attention stays bf16 under mixed precision.
    return (x_BhSd * cos_BSd.unsqueeze(-3) + rotated * sin_BSd.unsqueeze(-3)).to(x_BhSd.dtype)
