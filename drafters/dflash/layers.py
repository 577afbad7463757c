"""Block-drafter layers: attention with context K/V injection (GQA and MLA) and DFlash2's dynamic conv.

Context K/V injection (vLLM `DFlashQwen3Attention` + `precompute_and_store_context_kv`): the target context is
projected by each layer's own k/v projections, normed and rotated at its own positions, and stored; the block
queries attend over `[context K/V | block K/V]`. Nothing else of the layer runs on the context.

Shape legend: B batch, S context length, Q block queries, K keys, H drafter width, h heads, g kv heads,
d head width, G conv groups, T conv taps.
"""

import torch
from torch import nn

from draftsmith.drafters.dflash.block_attention import SplitMask, block_attention
from draftsmith.drafters.dflash.spec import DFlashSpec
from draftsmith.drafters.layers import RMSNorm, RopeScaling, apply_rope, rope_tables
from draftsmith.drafters.mla import MLAProjection, MLASpec
from draftsmith.kernels import dyn_conv


def _positions_BS(positions: torch.Tensor, B: int) -> torch.Tensor:
    return positions.expand(B, -1) if positions.dim() == 1 else positions


class DFlashGQA(nn.Module):
    """Qwen3 attention (per-head `q_norm`/`k_norm`, RoPE, scale 1/sqrt(d)) with injected context K/V."""

    def __init__(self, spec: DFlashSpec) -> None:
        super().__init__()
        self.h, self.g, self.d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.theta, self.rope_scaling = spec.rope_theta, RopeScaling.from_config(spec.rope_scaling)
        self.q_proj = nn.Linear(spec.hidden_size, self.h * self.d, bias=False)
        self.k_proj = nn.Linear(spec.hidden_size, self.g * self.d, bias=False)
        self.v_proj = nn.Linear(spec.hidden_size, self.g * self.d, bias=False)
        self.o_proj = nn.Linear(self.h * self.d, spec.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.d, spec.rms_norm_eps)
        self.k_norm = RMSNorm(self.d, spec.rms_norm_eps)
        self.scaling = self.d**-0.5

    def _rope(self, positions_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_tables(positions_BS, self.d, self.theta, self.rope_scaling)

    def kv(self, x_BSH: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`k` (normed, rotated) and `v`, both `[B, g, S, d]`; `positions` `[S]` or `[B, S]`."""
        B, S, _ = x_BSH.shape
        cos, sin = self._rope(_positions_BS(positions, B))
        k = self.k_norm(self.k_proj(x_BSH).view(B, S, self.g, self.d)).transpose(1, 2)
        v = self.v_proj(x_BSH).view(B, S, self.g, self.d).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(
        self,
        x_BQH: torch.Tensor,
        positions: torch.Tensor,
        ctx_kv: tuple[torch.Tensor, torch.Tensor],
        mask_B1QK: torch.Tensor | SplitMask,
    ) -> torch.Tensor:
        """`[B, Q, H]`: the block attends over `[ctx | block]` keys where the mask is True (a dense
        `[B, 1, Q, K]` bool, or a packed training mask in its two parts)."""
        B, Q, _ = x_BQH.shape
        cos, sin = self._rope(_positions_BS(positions, B))
        q = apply_rope(self.q_norm(self.q_proj(x_BQH).view(B, Q, self.h, self.d)).transpose(1, 2), cos, sin)
        k, v = self.kv(x_BQH, positions)
        rep = self.h // self.g
        if isinstance(mask_B1QK, SplitMask):
            ck, cv = (t.repeat_interleave(rep, dim=1) for t in ctx_kv)
            bk, bv = (t.repeat_interleave(rep, dim=1) for t in (k, v))
            out = block_attention(q, ck, cv, bk, bv, mask_B1QK, self.scaling)
        else:
            k, v = torch.cat([ctx_kv[0], k], dim=2), torch.cat([ctx_kv[1], v], dim=2)
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask_B1QK, scale=self.scaling)
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, self.h * self.d))


def mla_spec(spec: DFlashSpec) -> MLASpec:
    """The `MLASpec` of a drafter layer: `spec.mla` shapes plus the drafter's width, heads, eps and RoPE."""
    allowed = {"kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"}
    unknown = sorted(set(spec.mla or {}) - allowed)
    if unknown:
        raise ValueError(f"dflash.mla: unknown fields {unknown} (allowed: {sorted(allowed)})")
    return MLASpec(
        hidden_size=spec.hidden_size,
        num_heads=spec.num_heads,
        rms_norm_eps=spec.rms_norm_eps,
        rope_theta=spec.rope_theta,
        rope_scaling=spec.rope_scaling,
        **(spec.mla or {}),
    )


class DFlashMLA(MLAProjection):
    """MLA (HF DeepSeek-V3 names) with injected context K/V; no q_norm/k_norm (the latent norms play that part)."""

    def __init__(self, spec: DFlashSpec) -> None:
        super().__init__(mla_spec(spec))

    # `kv(x, positions)` (context and block K/V alike) is MLAProjection's.

    def forward(
        self,
        x_BQH: torch.Tensor,
        positions: torch.Tensor,
        ctx_kv: tuple[torch.Tensor, torch.Tensor],
        mask_B1QK: torch.Tensor | SplitMask,
    ) -> torch.Tensor:
        B, Q, _ = x_BQH.shape
        if isinstance(mask_B1QK, SplitMask):  # q/k and v widths differ: the flash merge does not apply
            mask_B1QK = mask_B1QK.dense()
        q, k, v = self.project(x_BQH, positions)
        k, v = torch.cat([ctx_kv[0], k], dim=2), torch.cat([ctx_kv[1], v], dim=2)
        out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask_B1QK, scale=self.scaling)
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, -1))


class GroupedConv(nn.Module):
    """DFlash2's dynamic depthwise conv over block positions (vLLM `DFlashGroupedConv`, `qwen3_dflash2.py`).

    `prepare(x)` reads per-row, per-group kernel corrections `delta` `[B, Q, 2, T, G]` from
    `kernel_projection(x)` (x = the normed sublayer input), convolves x with side 0 and returns side 1's
    corrections; `finish(y, delta1)` convolves the sublayer output with side 1. Output row t, channel c:
    `sum_j [pos(t) >= j] * (base_kernel[side, j, c] + delta[t, j, group(c)]) * x[t - j, c]`, where pos(t) is
    t's offset inside its block, so nothing leaks across block boundaries. Queries are laid out in whole
    blocks (`Q` a multiple of `block_size`), as in training and in vLLM's per-request query layout.
    Identity init (base tap 0 = 1, the rest 0, zero projection) makes the layer plain DFlash.
    """

    def __init__(self, hidden_size: int, taps: int, group_size: int, block_size: int) -> None:
        super().__init__()
        self.taps, self.group_size, self.block_size = taps, group_size, block_size
        self.num_groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, taps, hidden_size))
        with torch.no_grad():
            self.base_kernel[:, 0] = 1.0
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.num_groups, bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def _convolve(self, x_BQH: torch.Tensor, delta_BQTG: torch.Tensor, side: int) -> torch.Tensor:
        # `draftsmith.kernels.dyn_conv`: the Triton kernel on CUDA; under torch.compile the traced reference.
        mode = "reference" if torch.compiler.is_compiling() else None
        return dyn_conv(x_BQH, self.base_kernel[side], delta_BQTG, self.block_size, mode=mode)

    def prepare(self, x_BQH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, Q, _ = x_BQH.shape
        delta = self.kernel_projection(x_BQH).view(B, Q, 2, self.taps, self.num_groups)
        return self._convolve(x_BQH, delta[:, :, 0], 0), delta[:, :, 1]

    def finish(self, y_BQH: torch.Tensor, delta_BQTG: torch.Tensor) -> torch.Tensor:
        return self._convolve(y_BQH, delta_BQTG, 1)
