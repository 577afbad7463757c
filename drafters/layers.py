"""Layers shared by the drafters: RMSNorm, rotary embeddings (plain and YaRN), SwiGLU MLP.

Shape legend: B batch, S sequence, D model width, h heads, d head width.
"""

import math
from dataclasses import dataclass

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Llama RMSNorm, computed in fp32 whatever the storage dtype."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x32).to(x.dtype)


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


def _yarn_inv_freq(head_dim: int, theta: float, s: RopeScaling) -> tuple[torch.Tensor, float]:
    """YaRN's blended inverse frequencies `[d/2]` and its cos/sin scale."""
    if s.original_max_position_embeddings is None:
        raise ValueError("rope_parameters.original_max_position_embeddings: required for yarn")
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (s.factor * pos_freqs)

    def correction_dim(rotations: float) -> float:
        return (
            head_dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))
        )

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
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
    if scaling is None or scaling.rope_type == "default":
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        att = 1.0
    else:
        inv_freq, att = _yarn_inv_freq(head_dim, theta, scaling)
    angles = positions.float()[..., None] * inv_freq
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos() * att, emb.sin() * att


def apply_rope(x_BhSd: torch.Tensor, cos_BSd: torch.Tensor, sin_BSd: torch.Tensor) -> torch.Tensor:
    """Rotate `[B, h, S, d]` by tables broadcastable to `[B, 1, S, d]`."""
    half = x_BhSd.shape[-1] // 2
    rotated = torch.cat([-x_BhSd[..., half:], x_BhSd[..., :half]], dim=-1)
    # The tables are fp32; the result keeps x's dtype so bf16 attention stays bf16 under mixed precision.
    return (x_BhSd * cos_BSd.unsqueeze(-3) + rotated * sin_BSd.unsqueeze(-3)).to(x_BhSd.dtype)
