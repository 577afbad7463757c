"""Block-drafter labels, slot weights and the DFlash(2) objective.

Slot k of the block at anchor a predicts token a + k (DFlash, k >= 1; slot 0 holds the known anchor) or
a + k + 1 (DSpark, `predict_anchor`, every slot). A slot is valid only inside the contiguous supervised prefix:
every label position from the first predicted slot up to it is a loss token and inside the sequence
(DeepSpec's cumprod). Weighting: the total is the weighted MEAN over valid slots,
`sum w_k * CE / sum w_k` (SpecForge's choice), so a batch's total does not scale with how many slots it has.

Shape legend: B batch, S sequence, N anchors, K block slots, V vocabulary (Vd draft vocabulary), n valid rows.
"""

import torch
from torch import nn

from draftsmith.drafters.anchors import uniform_anchors
from draftsmith.drafters.layers import HeadLossCall
from draftsmith.drafters.objective import StepLoss
from draftsmith.drafters.vocab import target_to_draft


def slot_labels(
    input_ids_BS: torch.Tensor,
    loss_mask_BS: torch.Tensor,
    anchors_BN: torch.Tensor,
    keep_BN: torch.Tensor,
    block: int,
    predict_anchor: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`labels` `[B, N, block]` (target ids, 0 where invalid) and `valid` `[B, N, block]` bool."""
    S = input_ids_BS.shape[1]
    first = 0 if predict_anchor else 1
    pos = anchors_BN[:, :, None] + torch.arange(block, device=anchors_BN.device) + (1 - first)  # label positions
    inside = pos < S
    clamped = pos.clamp(max=S - 1)
    flat = clamped.flatten(1)
    supervised = loss_mask_BS.bool().gather(1, flat).view_as(pos) & inside
    if not predict_anchor:
        supervised[:, :, 0] = True  # the anchor slot is not a prediction; it must not break the prefix
    valid = supervised.int().cumprod(-1).bool() & keep_BN.bool()[:, :, None]
    if not predict_anchor:
        valid[:, :, 0] = False
    labels = torch.where(valid, input_ids_BS.gather(1, flat).view_as(pos), torch.zeros_like(pos))
    return labels, valid


def slot_weights(block: int, gamma: float, predict_anchor: bool) -> torch.Tensor:
    """`[block]`: DFlash `exp(-(k-1)/gamma)` for k >= 1 (slot 0 weighs 0); DSpark `exp(-k/gamma)`."""
    k = torch.arange(block, dtype=torch.float32)
    if predict_anchor:
        return torch.exp(-k / gamma)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def slot_ce(logits_nV: torch.Tensor, labels_n: torch.Tensor, slot_n: torch.Tensor, weights_K: torch.Tensor) -> StepLoss:
    """`StepLoss` over valid rows: per-slot mean CE, argmax accuracy and count; total = weighted mean."""
    ce = nn.functional.cross_entropy(logits_nV.float(), labels_n, reduction="none")
    hit = (logits_nV.argmax(-1) == labels_n).float()
    w = weights_K.to(ce.device)[slot_n]
    total = (w * ce).sum() / w.sum().clamp(min=1e-12)
    return _slot_stats(total, ce, hit, slot_n, weights_K.numel())


def slot_ce_fused(model, h_nH: torch.Tensor, labels_n: torch.Tensor, slot_n: torch.Tensor, weights_K: torch.Tensor):
    """`slot_ce(model.logits(h_nH), ...)` by the fused head loss (`kernels.head_loss`; no `[n, V]` logits)."""
    w = weights_K.float().to(h_nH.device)[slot_n]
    out = model.lm_head.fused_loss(h_nH, HeadLossCall(labels=labels_n, w_ce=w / w.sum().clamp(min=1e-12)))
    return _slot_stats(out.loss, out.ce, out.hit.float(), slot_n, weights_K.numel())


def _slot_stats(total: torch.Tensor, ce_n: torch.Tensor, hit_n: torch.Tensor, slot_n: torch.Tensor, K: int):
    count = torch.zeros(K, device=ce_n.device).index_add_(0, slot_n, torch.ones_like(ce_n))
    denom = count.clamp(min=1)
    step_loss = torch.zeros(K, device=ce_n.device).index_add_(0, slot_n, ce_n) / denom
    step_acc = torch.zeros(K, device=ce_n.device).index_add_(0, slot_n, hit_n) / denom
    return StepLoss(total=total, step_loss=step_loss, step_acc=step_acc, step_count=count.long())


def _to_output_vocab(
    labels: torch.Tensor, valid: torch.Tensor, t2d_V: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    if t2d_V is None:
        return labels, valid
    index = target_to_draft(t2d_V).to(labels.device)[labels]
    return index.clamp(min=0), valid & (index >= 0)


def dflash_loss(
    logits_BNKV: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor,
    weights: torch.Tensor,
    t2d_V: torch.Tensor | None = None,
) -> StepLoss:
    """Weighted CE over valid slots. With a pruned vocabulary (`t2d_V`), labels map to draft ids and labels
    outside the draft vocabulary are invalid."""
    labels, valid = _to_output_vocab(labels, valid, t2d_V)
    b, n, k = valid.nonzero(as_tuple=True)
    return slot_ce(logits_BNKV[b, n, k], labels[b, n, k], k, weights)


def dflash_objective(
    model,
    batch: dict,
    *,
    target_head_VH: torch.Tensor | None,
    generator: torch.Generator,
    num_anchors: int,
    gamma: float,
    selector_alpha: float,
) -> StepLoss:
    """One DFlash / DFlash2 training step's loss (CE on the dataset tokens, plus the selector's when on).

    `target_head_VH` is unused: the drafter's own `lm_head` already is the target's frozen head (or its trained
    pruned head); it is in the signature so every block objective (DSpark needs it for p_t) is called alike.
    Only valid slots reach the `[n, V]` logits. Anchors: `uniform_anchors(..., depth=block)`.
    """
    from draftsmith.drafters.dflash.selector import selector_loss

    del target_head_VH
    spec = model.spec
    block = spec.block_size
    ids, mask = batch["input_ids"], batch["loss_mask"]
    anchors, keep = uniform_anchors(mask, num_anchors, generator, depth=block)
    anchors, keep = anchors.to(ids.device), keep.to(ids.device)
    h = model.train_hidden(ids, batch["features"], anchors, keep)
    labels, valid = slot_labels(ids, mask, anchors, keep, block, spec.predict_anchor)
    out_labels, out_valid = _to_output_vocab(labels, valid, getattr(model, "t2d", None))
    b, n, k = out_valid.nonzero(as_tuple=True)
    weights = slot_weights(block, gamma, spec.predict_anchor)
    if not (spec.selector_rank and selector_alpha):
        loss = slot_ce_fused(model, h[b, n, k], out_labels[b, n, k], k, weights)
    else:
        # The selector re-ranks the unary top-K, so it needs the `[n, V]` logits themselves.
        logits = model.logits(h[b, n, k])
        loss = slot_ce(logits, out_labels[b, n, k], k, weights)
        # Teacher forcing: a slot's predecessor is the token just before its label (the anchor for the first slot).
        pred = ids[b, anchors[b, n] + k - spec.first_slot]
        sel = selector_loss(model.candidate_selector, logits, h[b, n, k], pred, labels[b, n, k])
        loss = StepLoss(loss.total + selector_alpha * sel, loss.step_loss, loss.step_acc, loss.step_count)
    # Report the predicting slots only: slot 0 holds the verified anchor and never counts.
    first = spec.first_slot
    return StepLoss(loss.total, loss.step_loss[first:], loss.step_acc[first:], loss.step_count[first:])
