"""The attention of training-time test: causal over the depth-0 keys, plus one key per later depth at the query's
own position (the keys an inference-time chain sees; `model.Eagle3Drafter.ttt_hidden`).

`chain_attention_reference` builds the `[B, h, S, S + n]` scores and softmaxes them. `ChainAttention` (CPU, equal
q/k/v widths) runs the causal part through torch's CPU flash-attention kernel, which never holds `[S, S]` scores
and skips the masked half, and merges the n extra keys by their log-sum-exp. Its backward calls the kernel's
backward with two changes that make it the backward of the merged softmax:

- the incoming gradient is scaled by the causal part's weight `w_b = exp(lse_b - L)` (L: the merged log-sum-exp);
- the kernel's `out` argument, which it reads only for `D = rowsum(dO * O)`, is the merged output, so that
  `dS = P (dP - D)` uses the merged softmax's D. (With `g_o` the gradient of the merged output o, the causal part's
  gradients are those of `g_o` through `w_b * out_b` and of `lse_b` through `w_b`; the two together are exactly
  the kernel's formula with `dO = w_b g_o` and `O = o`.)

Shape legend: B batch, h heads, S sequence, d q/k width, dv value width, n extra keys (depths 1..k).
"""

import torch

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def chain_attention(
    q_BhSd: torch.Tensor,
    k_BhSd: torch.Tensor,
    v_BhSd: torch.Tensor,
    diag_k: list[torch.Tensor],
    diag_v: list[torch.Tensor],
    scale: float,
) -> torch.Tensor:
    """`[B, h, S, dv]`: query t attends to `k[..., :t+1, :]` and to `diag_k[j][..., t, :]` for every j.

    Args:
        q_BhSd, k_BhSd, v_BhSd: the query and the depth-0 keys and values (kv heads already expanded).
        diag_k, diag_v: per later depth, its keys `[B, h, S, d]` and values `[B, h, S, dv]` (position t for query t).
        scale: the softmax scale.
    """
    flash = q_BhSd.device.type == "cpu" and q_BhSd.shape[-1] == k_BhSd.shape[-1] == v_BhSd.shape[-1]
    if flash and q_BhSd.dtype in (torch.float32, torch.bfloat16):
        return ChainAttention.apply(q_BhSd, k_BhSd, v_BhSd, scale, *diag_k, *diag_v)
    return chain_attention_reference(q_BhSd, k_BhSd, v_BhSd, diag_k, diag_v, scale)


def chain_attention_reference(q_BhSd, k_BhSd, v_BhSd, diag_k, diag_v, scale) -> torch.Tensor:
    """`chain_attention` from the full `[B, h, S, S + n]` scores (plain autograd)."""
    S = q_BhSd.shape[-2]
    causal = torch.ones(S, S, dtype=torch.bool, device=q_BhSd.device).tril()
    scores = (q_BhSd @ k_BhSd.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))
    diag = [(q_BhSd * dk).sum(-1, keepdim=True) * scale for dk in diag_k]
    probs = torch.cat([scores, *diag], dim=-1).softmax(-1)
    out = probs[..., :S] @ v_BhSd
    for j, dv in enumerate(diag_v):
        out = out + probs[..., S + j : S + j + 1] * dv
    return out


class ChainAttention(torch.autograd.Function):
    """`chain_attention` by the CPU flash-attention kernel plus a log-sum-exp merge (see the module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, scale, *diag):
        n = len(diag) // 2
        out_b, lse_b = _FLASH(q, k, v, 0.0, True, scale=scale)  # [B, h, S, dv], [B, h, S] fp32
        w_b = w_d = None
        out = out_b
        if n:
            s = torch.stack([(q * dk).sum(-1) for dk in diag[:n]], -1).float() * scale  # [B, h, S, n]
            lse = torch.logsumexp(torch.cat([lse_b.unsqueeze(-1), s], -1), -1, keepdim=True)
            w_b, w_d = (lse_b.unsqueeze(-1) - lse).exp(), (s - lse).exp()  # [B, h, S, 1], [B, h, S, n]
            merged = out_b.float() * w_b
            for j, dv in enumerate(diag[n:]):
                merged.addcmul_(w_d[..., j : j + 1], dv)
            out = merged.to(q.dtype)
        ctx.scale, ctx.n = scale, n
        ctx.save_for_backward(q, k, v, out, lse_b, w_b, w_d, *diag)
        return out

    @staticmethod
    def backward(ctx, g_out):
        q, k, v, out, lse_b, w_b, w_d, *diag = ctx.saved_tensors
        n, scale = ctx.n, ctx.scale
        g_b = g_out if w_b is None else (g_out.float() * w_b).to(q.dtype)
        dq, dk, dv = _FLASH_BACKWARD(g_b.contiguous(), q, k, v, out, lse_b, 0.0, True, scale=scale)
        if not n:
            return dq, dk, dv, None
        g = g_out.float()
        g_dot_out = (g * out.float()).sum(-1, keepdim=True)  # D of the merged softmax, [B, h, S, 1]
        dq = dq.float()
        grads_k, grads_v = [], []
        for j, (dkj, dvj) in enumerate(zip(diag[:n], diag[n:], strict=True)):
            wj = w_d[..., j : j + 1]
            ds = wj * ((g * dvj).sum(-1, keepdim=True) - g_dot_out) * scale  # d loss / d (q . dk_j) * scale
            dq.addcmul_(ds, dkj)
            grads_k.append((ds * q).to(dkj.dtype))
            grads_v.append((wj * g).to(dvj.dtype))
        return dq.to(q.dtype), dk, dv, None, *grads_k, *grads_v
