"""Layers shared by the drafters: RMSNorm, rotary embeddings, SwiGLU MLP.

Shape legend: B batch, S sequence, D model width, h heads, d head width.
"""

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


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin `[..., d]` for integer `positions` `[...]` (Llama's half-split layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = positions.float()[..., None] * inv_freq
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x_BhSd: torch.Tensor, cos_BSd: torch.Tensor, sin_BSd: torch.Tensor) -> torch.Tensor:
    """Rotate `[B, h, S, d]` by tables broadcastable to `[B, 1, S, d]`."""
    half = x_BhSd.shape[-1] // 2
    rotated = torch.cat([-x_BhSd[..., half:], x_BhSd[..., :half]], dim=-1)
    return x_BhSd * cos_BSd.unsqueeze(-3) + rotated * sin_BSd.unsqueeze(-3)
