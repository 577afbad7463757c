"""Training attention of the block drafters with the context and each block's own keys kept apart.

In a packed training forward (`model.DFlashDrafter.train_hidden`) the N blocks' queries attend over
`[context | all N blocks]`, but a query sees only context keys before its anchor and the keys of its own block
(`block_masks`). The dense form scores every query against every block's keys: with 512 anchors of 8 slots
that is 4096 block keys per query of which 8 are used, about 80% of the attention's work at sequence 1024.

`SplitMask` keeps the two parts apart: the context part `[B, 1, Q, S]` and the own-block part `[B, 1, N, b, b]`.
`BlockAttention` (CPU, equal q/k/v widths) runs the context part through torch's CPU flash-attention kernel and
the own-block part as N small `b x b` attentions, and merges the two by their log-sum-exp. Its backward is the
kernel's backward with the incoming gradient scaled by the context part's weight and the merged output as the
kernel's `out` (the argument `drafters.eagle3.chain_attention` explains), plus the own part's softmax backward.
A row with no context key at all (a dropped slot, or an anchor at position 0) gets one zero key that only it
sees, so the kernel never meets an empty row; its weight in the merge is then set to 0.
`block_attention_reference` is the dense form, used off CPU and as the parity reference.

Shape legend: B batch, h heads, N blocks, b block length, Q = N*b queries, S context length, d head width.
"""

from typing import NamedTuple

import torch
from torch import nn

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class SplitMask(NamedTuple):
    """A packed training mask in two parts: `ctx` `[B, 1, Q, S]` and `own` `[B, 1, N, b, b]` (bool)."""

    ctx: torch.Tensor
    own: torch.Tensor

    def dense(self) -> torch.Tensor:
        """The same mask over `[context | all blocks]`: `[B, 1, Q, S + Q]` (`block_masks.train_mask`)."""
        B, _, N, b, _ = self.own.shape
        eye = torch.eye(N, dtype=torch.bool, device=self.own.device)
        blk = self.own[:, 0, :, :, None, :] & eye[None, :, None, :, None]  # [B, N, b, N, b]
        return torch.cat([self.ctx, blk.reshape(B, 1, N * b, N * b)], dim=-1)


def block_attention(
    q_BhQd: torch.Tensor,
    ctx_k: torch.Tensor,
    ctx_v: torch.Tensor,
    blk_k: torch.Tensor,
    blk_v: torch.Tensor,
    mask: SplitMask,
    scale: float,
) -> torch.Tensor:
    """`[B, h, Q, d]`: query i of block n attends to context keys where `mask.ctx[.., i, :]` and to block n's
    own keys where `mask.own[.., n, i % b, :]`.

    Args:
        q_BhQd: the block queries (rotated); blk_k, blk_v: the blocks' keys and values `[B, h, Q, d]`.
        ctx_k, ctx_v: the context keys and values `[B, h, S, d]` (kv heads already expanded).
        mask: the two-part mask; scale: the softmax scale.
    """
    same = q_BhQd.shape[-1] == ctx_k.shape[-1] == ctx_v.shape[-1]
    if q_BhQd.device.type == "cpu" and same and q_BhQd.dtype in (torch.float32, torch.bfloat16):
        return BlockAttention.apply(q_BhQd, ctx_k, ctx_v, blk_k, blk_v, mask.ctx, mask.own, scale)
    return block_attention_reference(q_BhQd, ctx_k, ctx_v, blk_k, blk_v, mask, scale)


def block_attention_reference(q_BhQd, ctx_k, ctx_v, blk_k, blk_v, mask: SplitMask, scale: float) -> torch.Tensor:
    """`block_attention` as one dense SDPA over `[context | all blocks]` (plain autograd)."""
    k, v = torch.cat([ctx_k, blk_k], dim=2), torch.cat([ctx_v, blk_v], dim=2)
    return nn.functional.scaled_dot_product_attention(q_BhQd, k, v, attn_mask=mask.dense(), scale=scale)


def _context_inputs(ctx_k, ctx_v, ctx_mask) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys, values and additive mask `[B, 1, Q, S(+1)]` for the kernel, and the rows without a context key
    `[B, 1, Q]`. Such rows see one extra zero key (only they do) instead of none."""
    empty = ~ctx_mask.any(-1)
    if bool(empty.any()):
        zero = ctx_k.new_zeros(*ctx_k.shape[:2], 1, ctx_k.shape[-1])
        ctx_k, ctx_v = torch.cat([ctx_k, zero], dim=2), torch.cat([ctx_v, zero], dim=2)
        ctx_mask = torch.cat([ctx_mask, empty[..., None]], dim=-1)
    additive = torch.zeros(ctx_mask.shape, dtype=ctx_k.dtype, device=ctx_k.device)
    return ctx_k, ctx_v, additive.masked_fill_(~ctx_mask, float("-inf")), empty


class BlockAttention(torch.autograd.Function):
    """`block_attention` by the CPU flash kernel plus a log-sum-exp merge (see the module docstring)."""

    @staticmethod
    def forward(ctx, q, ctx_k, ctx_v, blk_k, blk_v, ctx_mask, own_mask, scale):
        B, h, Q, d = q.shape
        N, b = own_mask.shape[2], own_mask.shape[3]
        S = ctx_k.shape[2]
        ck, cv, additive, empty = _context_inputs(ctx_k, ctx_v, ctx_mask)
        out_c, lse_c = _FLASH(q, ck, cv, 0.0, False, attn_mask=additive, scale=scale)  # [B,h,Q,d], [B,h,Q] fp32
        lse_ctx = lse_c.masked_fill(empty.expand(B, h, Q), float("-inf"))
        qb, kb, vb = (t.reshape(B, h, N, b, d) for t in (q, blk_k, blk_v))
        s = (qb @ kb.transpose(-1, -2)).float() * scale  # [B, h, N, b, b]
        s = s.masked_fill(~own_mask, float("-inf"))
        lse = torch.logaddexp(lse_ctx, torch.logsumexp(s, -1).reshape(B, h, Q))  # merged, [B, h, Q]
        w_c = (lse_ctx - lse).exp()  # context share of each row
        p_own = (s - lse.reshape(B, h, N, b, 1)).exp()  # [B, h, N, b, b]
        out = (out_c.float() * w_c[..., None]).add_((p_own @ vb.float()).reshape(B, h, Q, d)).to(q.dtype)
        ctx.scale, ctx.S = scale, S
        ctx.save_for_backward(q, ck, cv, kb, vb, additive, out, lse_c, w_c, p_own)
        return out

    @staticmethod
    def backward(ctx, g_out):
        q, ck, cv, kb, vb, additive, out, lse_c, w_c, p_own = ctx.saved_tensors
        scale, S = ctx.scale, ctx.S
        B, h, N, b, d = kb.shape
        g_c = (g_out.float() * w_c[..., None]).to(q.dtype).contiguous()
        dq, dck, dcv = _FLASH_BACKWARD(g_c, q, ck, cv, out, lse_c, 0.0, False, attn_mask=additive, scale=scale)
        g = g_out.float().reshape(B, h, N, b, d)
        D = (g_out.float() * out.float()).sum(-1).reshape(B, h, N, b, 1)  # rowsum(dO * O) of the merged softmax
        ds = p_own * (g @ vb.float().transpose(-1, -2) - D) * scale  # [B, h, N, b, b]
        qb = q.float().reshape(B, h, N, b, d)
        dq = dq.float().add_((ds @ kb.float()).reshape(B, h, N * b, d))
        dkb = (ds.transpose(-1, -2) @ qb).reshape(B, h, N * b, d)
        dvb = (p_own.transpose(-1, -2) @ g).reshape(B, h, N * b, d)
        dt = q.dtype
        return dq.to(dt), dck[:, :, :S], dcv[:, :, :S], dkb.to(dt), dvb.to(dt), None, None, None
