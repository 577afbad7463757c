"""Multi-head latent attention (MLA, DeepSeek-V2/V3 and Kimi K3), for MLA drafter layers.

Queries go through an optional low-rank bottleneck (`q_a_proj` → RMSNorm → `q_b_proj`); keys and values
share one compressed latent (`kv_a_proj_with_mqa` → RMSNorm → `kv_b_proj`) plus a single rotary key part
shared by every head (decoupled RoPE dims). Parameter names and the rotate-half RoPE layout follow the HF
DeepSeek-V3 implementation (`rope_interleave: false`), so a drafter layer can start from, and export to,
target-style checkpoints; `tests/unit/test_mla.py` checks it against that implementation, YaRN included.

Shape legend: B batch, S sequence, D model width, h heads, r latent rank, dn/dr/dv no-RoPE, RoPE and value
head widths, Q queries, K keys.
"""

from dataclasses import dataclass

import torch
from torch import nn

from draftsmith.drafters.layers import RMSNorm, RopeScaling, _yarn_mscale, apply_rope, rope_tables


@dataclass(frozen=True)
class MLASpec:
    """The shapes of one MLA layer (`q_lora_rank` None: a plain `q_proj`)."""

    hidden_size: int
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rope_interleave: bool = False  # rotate pairs (2i, 2i+1), as vLLM's MLA (is_neox_style=False) does


class MLAProjection(nn.Module):
    """MLA's projections, norms and RoPE (HF DeepSeek-V3 names); `MLAttention` adds self-attention as `forward`,
    drafter layers attend over their own context instead."""

    def __init__(self, spec: MLASpec) -> None:
        super().__init__()
        self.spec = spec
        h, dn, dr, dv = spec.num_heads, spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim
        if spec.q_lora_rank is None:
            self.q_proj = nn.Linear(spec.hidden_size, h * (dn + dr), bias=False)
        else:
            self.q_a_proj = nn.Linear(spec.hidden_size, spec.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(spec.q_lora_rank, spec.rms_norm_eps)
            self.q_b_proj = nn.Linear(spec.q_lora_rank, h * (dn + dr), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(spec.hidden_size, spec.kv_lora_rank + dr, bias=False)
        self.kv_a_layernorm = RMSNorm(spec.kv_lora_rank, spec.rms_norm_eps)
        self.kv_b_proj = nn.Linear(spec.kv_lora_rank, h * (dn + dv), bias=False)
        self.o_proj = nn.Linear(h * dv, spec.hidden_size, bias=False)
        self.rope_scaling = RopeScaling.from_config(spec.rope_scaling)
        self.scaling = (dn + dr) ** -0.5
        s = self.rope_scaling
        if s.rope_type == "yarn" and s.mscale_all_dim:
            # DeepSeek's YaRN also scales the softmax temperature by mscale(all dims) squared.
            self.scaling *= _yarn_mscale(s.factor, s.mscale_all_dim) ** 2

    def project(
        self, x_BSD: torch.Tensor, positions_S: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`q` and `k` `[B, h, S, dn + dr]` (RoPE applied to the last dr dims), `v` `[B, h, S, dv]`."""
        return self.query(x_BSD, positions_S), *self.kv(x_BSD, positions_S)

    def query(self, x_BSD: torch.Tensor, positions_S: torch.Tensor) -> torch.Tensor:
        """`q` `[B, h, S, dn + dr]`; `positions` `[S]` or `[B, S]`."""
        sp = self.spec
        B, S, _ = x_BSD.shape
        dn, dr = sp.qk_nope_head_dim, sp.qk_rope_head_dim
        q = self.q_proj(x_BSD) if sp.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BSD)))
        q = q.view(B, S, sp.num_heads, dn + dr).transpose(1, 2)
        cos, sin = self.rope(positions_S)
        return torch.cat([q[..., :dn], apply_rope(self._layout(q[..., dn:]), cos, sin)], -1)

    def kv(self, x_BSD: torch.Tensor, positions_S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`k` `[B, h, S, dn + dr]` (one rotary part shared by the heads) and `v` `[B, h, S, dv]`."""
        sp = self.spec
        B, S, _ = x_BSD.shape
        h, dn, dr, dv = sp.num_heads, sp.qk_nope_head_dim, sp.qk_rope_head_dim, sp.v_head_dim
        latent, k_rot = self.kv_a_proj_with_mqa(x_BSD).split([sp.kv_lora_rank, dr], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(B, S, h, dn + dv).transpose(1, 2)
        k_nope, v = kv.split([dn, dv], dim=-1)
        cos, sin = self.rope(positions_S)
        k_rot = apply_rope(self._layout(k_rot.view(B, 1, S, dr)), cos, sin).expand(B, h, S, dr)
        return torch.cat([k_nope, k_rot], -1), v

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_tables(positions, self.spec.qk_rope_head_dim, self.spec.rope_theta, self.rope_scaling)

    def _layout(self, x: torch.Tensor) -> torch.Tensor:
        """Interleaved pairs `(x[2i], x[2i+1])` moved to `(y[i], y[i + d/2])` so half-split RoPE rotates them.

        The rotated dims then come out de-interleaved (as HF does); q and k share that order, so `q @ k^T` is
        exactly the interleaved-RoPE score.
        """
        if not self.spec.rope_interleave:
            return x
        *lead, d = x.shape
        return x.view(*lead, d // 2, 2).transpose(-1, -2).reshape(*lead, d)


class MLAttention(MLAProjection):
    """Multi-head latent attention over the sequence itself."""

    def forward(self, x_BSD: torch.Tensor, positions_S: torch.Tensor, mask_B1QK: torch.Tensor) -> torch.Tensor:
        """`[B, S, D]`; `mask_B1QK` is a boolean mask (`drafters.masks.dense`), True where attention is allowed."""
        q, k, v = self.project(x_BSD, positions_S)
        out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask_B1QK, scale=self.scaling)
        B, _, S, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(B, S, -1))
