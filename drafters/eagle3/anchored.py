"""Anchored EAGLE-3 TTT (TorchSpec PR #186): the TTT chain run only from N sampled anchors, not from all S.

Context keys/values for every position come from one pointwise pass (`[norm(embed(x_{t+1})); norm(fc(f_t))]`
at RoPE position t). Depth 0 queries the anchors against that context. Depth d >= 1 feeds slot n the
embedding of token a+1+d and the previous depth's output (normed if `norm_output`), at RoPE position a+d.
Slot n attends to the context up to its anchor and to its own slot of depths 1..d (`drafters.masks.anchored_ttt`);
anchors never see each other. So the computation at anchor a and depth d is exactly dense TTT's at t = a,
step d, and with every position an anchor the loss equals dense TTT's (tested). Each depth costs N queries
instead of S. Alignment, labels and weights follow `eagle3.loss`.

Shape legend: B batch, S sequence, N anchor slots, H drafter width, Ht target width, Vd draft vocabulary.
"""

import torch
from torch import nn

from draftsmith.drafters import masks
from draftsmith.drafters.eagle3.loss import TTTLoss, combine, depth_term
from draftsmith.drafters.eagle3.model import Eagle3Drafter, shift_left
from draftsmith.drafters.layers import HeadLossCall
from draftsmith.kernels import Target


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    # The scale is the attention's own (MLA's differs from 1/sqrt(q width) under DeepSeek YaRN).
    return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)


def anchored_hidden(
    model: Eagle3Drafter,
    input_ids_BS: torch.Tensor,
    features_BSF: torch.Tensor,
    anchors_BN: torch.Tensor,
    keep_BN: torch.Tensor,
    depth: int,
) -> list[torch.Tensor]:
    """The layer output `[B, N, H]` at every anchor slot, for each depth 0..depth-1."""
    layer, attn = model.midlayer, model.midlayer.self_attn
    B, S = input_ids_BS.shape
    N = anchors_BN.shape[1]
    dev = input_ids_BS.device
    fused = model.fuse(features_BSF)  # [B, S, H]
    ctx_in = layer.attn_input(model.embed_tokens(shift_left(input_ids_BS, 1)), fused)
    _, keys, values = attn.qkv(ctx_in, torch.arange(S, device=dev))  # the depth-0 keys of every position
    rows = torch.arange(B, device=dev)[:, None]
    hidden = fused[rows, anchors_BN]  # [B, N, H]
    outputs: list[torch.Tensor] = []
    for d in range(depth):
        tokens = shift_left(input_ids_BS, 1 + d)[rows, anchors_BN]
        x = layer.attn_input(model.embed_tokens(tokens), hidden)
        q, k_new, v_new = attn.qkv(x, anchors_BN + d)  # per-slot RoPE positions [B, N]
        if d == 0:
            # Dropped slots hold anchor 0, so they see position 0 and stay finite; the loss ignores them.
            allowed = (torch.arange(S, device=dev)[None, :] <= anchors_BN[..., None])[:, None]
        else:
            keys, values = torch.cat([keys, k_new], dim=2), torch.cat([values, v_new], dim=2)
            allowed = masks.dense(masks.anchored_ttt(anchors_BN, keep_BN, S, d), B, N, S + d * N, device=dev)
        h_out = layer.finish(_attend(q, keys, values, allowed, attn.scale), hidden)
        outputs.append(h_out)
        hidden = model.norm(h_out) if model.spec.norm_output else h_out
    return outputs


def anchored_loss(
    model: Eagle3Drafter,
    step_hidden: list[torch.Tensor],
    anchors_BN: torch.Tensor,
    keep_BN: torch.Tensor,
    last_hidden_BSHt: torch.Tensor,
    draft_head_VdHt: torch.Tensor,
    position_mask_BS: torch.Tensor,
    decay: float,
) -> TTTLoss:
    """Forward KL to the target at p = a + 1 + d, over kept slots whose p counts; mean per depth, decayed.
    The reference of `anchored_loss_fused` (it builds the `[n, Vd]` logits)."""
    terms = []
    for d, hidden in enumerate(step_hidden):
        valid, b, p = _depth_slots(anchors_BN, keep_BN, position_mask_BS, d)
        with torch.no_grad():
            target = (last_hidden_BSHt[b, p].to(draft_head_VdHt.dtype) @ draft_head_VdHt.T).float().log_softmax(-1)
        terms.append(depth_term(model.logits(hidden[valid]).float(), target))
    return combine(terms, decay)


def _depth_slots(anchors_BN: torch.Tensor, keep_BN: torch.Tensor, position_mask_BS: torch.Tensor, d: int):
    """Depth d's counted slots: the mask `[B, N]` over anchor slots, and their (row, position) `[n]` each,
    position p = anchor + 1 + d."""
    B, S = position_mask_BS.shape
    rows = torch.arange(B, device=anchors_BN.device)[:, None].expand_as(anchors_BN)
    p = anchors_BN + 1 + d
    pc = p.clamp(max=S - 1)
    valid = keep_BN & (p < S) & position_mask_BS[rows, pc]
    return valid, rows[valid], pc[valid]


def anchored_loss_fused(
    model: Eagle3Drafter,
    step_hidden: list[torch.Tensor],
    anchors_BN: torch.Tensor,
    keep_BN: torch.Tensor,
    last_hidden_BSHt: torch.Tensor,
    draft_head_VdHt: torch.Tensor,
    position_mask_BS: torch.Tensor,
    decay: float,
    target_logits_nVd: torch.Tensor | None = None,
) -> TTTLoss:
    """`anchored_loss` through the fused head loss: the draft logits `[n, Vd]` are never materialised, nor the
    target's, which come from `last_hidden @ draft_head.T` a chunk of rows at a time; or, given
    `target_logits_nVd` (the target's draft-vocabulary logits at `position_mask_BS.nonzero()`, made once per
    step by `target.SharedTarget`), are rows of that."""
    row_of = None
    if target_logits_nVd is not None:
        row_of = torch.full(position_mask_BS.shape, -1, dtype=torch.long, device=position_mask_BS.device)
        row_of[position_mask_BS] = torch.arange(target_logits_nVd.shape[0], device=row_of.device)
    terms = []
    for d, hidden in enumerate(step_hidden):
        valid, b, p = _depth_slots(anchors_BN, keep_BN, position_mask_BS, d)
        x = model.norm(hidden[valid])
        n = x.shape[0]
        mean = torch.full((n,), 1.0 / max(n, 1), device=x.device)
        if target_logits_nVd is None or row_of is None:
            target = Target(hidden=last_hidden_BSHt[b, p], head=draft_head_VdHt)
        else:
            target = Target(logits=target_logits_nVd[row_of[b, p]])
        out = model.lm_head.fused_loss(x, HeadLossCall(target=target, w_soft=mean))
        assert out.acc is not None  # a soft target always yields the argmax accuracy
        terms.append((out.loss, out.acc.float().sum() / max(n, 1), torch.tensor(n, device=x.device)))
    return combine(terms, decay)
