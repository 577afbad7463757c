"""The DSpark objective: `0.1 * CE + 0.9 * L1 + 1.0 * BCE`, each a slot-weighted mean (algorithms.md §1(c), §4).

Per counted slot (row): CE of the gold label under the draft distribution p_d (backbone logits plus the
Markov bias); L1 = sum_v |p_d - p_t| (twice the total variation to the target distribution p_t, so 1 - L1/2
is exactly the acceptance probability of speculative sampling at that slot); BCE-with-logits of the
confidence logit toward `c* = clamp(1 - L1/2, 0, 1)`, detached so the confidence head learns to *predict*
acceptance without pulling the draft distribution toward whatever makes it easy to predict.

Each term is `sum(w * term) / sum(w)` over the counted rows, with w = `weights_K[slot]` (DSpark:
exp(-k/4)). With a pruned draft vocabulary, rows whose label is outside the draft vocabulary are not counted,
and p_t is either the target's full-vocabulary distribution (the paper's: its mass outside the draft ids is
mass the drafter can never propose, so it counts in L1 and lowers c*; `outside_column`) or that distribution
renormalised over the draft ids (`target_logp`; optimistic by the outside mass).

Shape legend: B batch, N anchors, K block slots, V target vocabulary, Vout output (draft) vocabulary,
Ht target width, n counted rows.
"""

import dataclasses

import torch
import torch.nn.functional as F

from draftsmith.drafters.layers import HeadLossCall
from draftsmith.drafters.objective import StepLoss
from draftsmith.kernels import Target
from draftsmith.kernels.head_loss import chunk_rows_for

DEFAULT_MIX = (0.1, 0.9, 1.0)
# The draft's logit in the column standing for every id outside the draft vocabulary: far enough below any real
# logit that its probability is exactly 0 in fp32 and bf16, yet finite (no inf * 0 = NaN in the matmuls).
OUTSIDE_DRAFT_LOGIT = -1.0e4


def target_logp(target_head_VH: torch.Tensor, last_hidden_nH: torch.Tensor, draft_ids: torch.Tensor | None = None):
    """Target log-probabilities `[n, Vout]` at T = 1 from the target's post-norm last hidden state.

    Args:
        target_head_VH: the target's frozen lm_head weight `[V, Ht]`.
        last_hidden_nH: the target's post-final-norm last hidden state at the position *before* each label.
        draft_ids: target id of every draft id `[Vd]` (pruned vocabulary), or None for the full vocabulary.
            Taking only those head rows and normalising over them is the renormalised target distribution.
    """
    head = target_head_VH if draft_ids is None else target_head_VH[draft_ids]
    return (last_hidden_nH.to(head.dtype) @ head.T).float().log_softmax(-1)


@torch.no_grad()
def outside_logsumexp(
    last_hidden_nH: torch.Tensor, target_head_VH: torch.Tensor, t2d_V: torch.Tensor, chunk_rows: int | None = None
) -> torch.Tensor:
    """`[n]` fp32: logsumexp of the target's T = 1 logits over the ids *outside* the draft vocabulary.

    Args:
        last_hidden_nH: the target's post-norm last hidden state before each label `[n, Ht]`.
        target_head_VH: the target's whole lm_head `[V, Ht]` (the full logits, a chunk of rows at a time;
            masking beats gathering the outside rows, which would copy most of the head every step).
        t2d_V: True at the draft vocabulary's target ids `[V]`.
        chunk_rows: rows per chunk (default: the fused head loss's `[C, V]` budget).

    Floored at `OUTSIDE_DRAFT_LOGIT` (no id outside: no mass there).
    """
    inside = t2d_V.bool().to(target_head_VH.device)
    step = chunk_rows or chunk_rows_for(target_head_VH.shape[0])
    parts = [
        (rows.to(target_head_VH.dtype) @ target_head_VH.T).float().masked_fill(inside, float("-inf")).logsumexp(-1)
        for rows in last_hidden_nH.split(step)
    ]
    out = torch.cat(parts) if parts else last_hidden_nH.new_zeros(0, dtype=torch.float32)
    return out.clamp(min=OUTSIDE_DRAFT_LOGIT)


def outside_column(
    weight_VD: torch.Tensor, call: HeadLossCall, outside_n: torch.Tensor
) -> tuple[torch.Tensor, HeadLossCall]:
    """The head loss's operands over Vout + 1 columns, the last standing for every id outside the draft vocabulary.

    Target: `hidden @ head.T` gains the column `outside_n` (`outside_logsumexp`), so its softmax over the
    Vout + 1 columns is the full-vocabulary p_t on the draft ids plus the outside mass. Draft: that column's
    logit is `OUTSIDE_DRAFT_LOGIT` (through the extra low-rank term, a constant 1 against it), so p_d there is 0
    and L1 gains exactly the outside mass; CE, argmax and every gradient are the Vout columns' own.

    Args:
        weight_VD: the pruned lm_head weight `[Vout, D]`.
        call: its `HeadLossCall`, whose target is in hidden form (`hidden [n, Ht]`, `head [Vout, Ht]`) and whose
            `extra` is `(x2 [n, r], W2 [Vout, r])` or None.
        outside_n: `[n]` fp32.

    Returns:
        `(weight [Vout + 1, D], call)` with target `[n, Ht + 1]` / `[Vout + 1, Ht + 1]` and extra
        `[n, r + 1]` / `[Vout + 1, r + 1]`.
    """
    target = call.target
    if target is None or target.hidden is None or target.head is None:
        raise ValueError("outside_column: needs the target in hidden form (hidden + head)")
    n, V = outside_n.shape[0], weight_VD.shape[0]
    ex, ew = call.extra if call.extra is not None else (weight_VD.new_zeros(n, 0), weight_VD.new_zeros(V, 0))
    one = torch.ones(n, 1, dtype=ex.dtype, device=ex.device)
    column = torch.full((1, 1), OUTSIDE_DRAFT_LOGIT, dtype=ew.dtype, device=ew.device)
    # In the head's dtype, as `Target.rows` computes anyway: bf16 hidden states must not round the normaliser.
    dtype = target.head.dtype
    hidden = torch.cat([target.hidden.to(dtype), outside_n[:, None].to(dtype)], dim=1)
    head = torch.block_diag(target.head, target.head.new_ones(1, 1))
    return torch.cat([weight_VD, weight_VD.new_zeros(1, weight_VD.shape[1])]), dataclasses.replace(
        call,
        target=Target(hidden=hidden, head=head),
        extra=(torch.cat([ex, one], dim=1), torch.block_diag(ew, column)),
    )


def _weighted_mean(values_n: torch.Tensor, w_n: torch.Tensor) -> torch.Tensor:
    # An empty batch gives 0 (still attached to the graph), not NaN.
    return (w_n * values_n).sum() / w_n.sum().clamp(min=torch.finfo(w_n.dtype).tiny)


def _per_slot(values_n: torch.Tensor, slot_n: torch.Tensor, count_K: torch.Tensor) -> torch.Tensor:
    sums = torch.zeros(count_K.numel(), dtype=values_n.dtype, device=values_n.device)
    return sums.index_add(0, slot_n, values_n) / count_K.clamp(min=1)


def dspark_rows(
    logits_nV: torch.Tensor,
    conf_logit_n: torch.Tensor,
    target_logp_nV: torch.Tensor,
    labels_n: torch.Tensor,
    slot_n: torch.Tensor,
    weights_K: torch.Tensor,
    mix: tuple[float, float, float] = DEFAULT_MIX,
) -> StepLoss:
    """The DSpark loss over counted rows only (what `dspark_loss` reduces to; the objective calls it directly
    so that padding and uncounted slots never pay for `[*, Vout]` logits).

    Args:
        logits_nV: draft logits including the Markov bias, `[n, Vout]`.
        conf_logit_n: confidence logits `[n]`.
        target_logp_nV: target log-probabilities over the same vocabulary `[n, Vout]`.
        labels_n: gold label ids in the output vocabulary `[n]`.
        slot_n: block slot of each row `[n]` (0..K-1).
        weights_K: per-slot weights `[K]`.
        mix: weights of (CE, L1, BCE) in the total.

    Returns:
        `StepLoss` whose total is `mix . (CE, L1, BCE)`; per slot k, step_loss is the same mix of the slot's
        plain means, step_acc the fraction with argmax p_d == label, step_count the rows counted.
    """
    logp_d = logits_nV.float().log_softmax(-1)
    ce = -logp_d.gather(-1, labels_n[:, None]).squeeze(-1)
    l1 = (logp_d.exp() - target_logp_nV.float().exp()).abs().sum(-1)
    accept = (1.0 - 0.5 * l1).clamp(0.0, 1.0).detach()
    bce = F.binary_cross_entropy_with_logits(conf_logit_n.float(), accept, reduction="none")
    w = weights_K.float().to(logits_nV.device)[slot_n]
    ce_part, l1_part, bce_part = (m * _weighted_mean(t, w) for m, t in zip(mix, (ce, l1, bce), strict=True))
    total = ce_part + l1_part + bce_part
    count = torch.bincount(slot_n, minlength=weights_K.numel())
    row_loss = (mix[0] * ce + mix[1] * l1 + mix[2] * bce).detach()
    hit = (logp_d.argmax(-1) == labels_n).float()
    return StepLoss(
        total=total,
        step_loss=_per_slot(row_loss, slot_n, count),
        step_acc=_per_slot(hit, slot_n, count),
        step_count=count,
    )


def dspark_rows_fused(
    model,
    h_nH: torch.Tensor,
    prev_ids_n: torch.Tensor,
    target: Target,
    labels_n: torch.Tensor,
    slot_n: torch.Tensor,
    weights_K: torch.Tensor,
    mix: tuple[float, float, float] = DEFAULT_MIX,
    outside_n: torch.Tensor | None = None,
) -> StepLoss:
    """`dspark_rows(*model.heads(h_nH, prev_ids_n)[:2], target_logp, ...)` by the fused head loss
    (`draftsmith.kernels.head_loss`): the Markov bias `W2 @ W1[prev]` joins the lm_head as an extra low-rank term, so
    neither the draft nor the target `[n, Vout]` logits exist at once.

    Args:
        model: a `DSparkDrafter` (its `lm_head`, `markov_head` and optional `confidence_head`).
        h_nH: backbone outputs after the final norm `[n, H]`; prev_ids_n: previous tokens (target ids) `[n]`.
        target: the target distribution over the output vocabulary for the same rows.
        labels_n, slot_n, weights_K, mix: as `dspark_rows`.
        outside_n: with a pruned vocabulary, `outside_logsumexp` of the same rows `[n]`: p_t is then the
            full-vocabulary distribution (`outside_column`); None: `target` renormalised over the draft ids.
    """
    emb = model.markov_head.embed(prev_ids_n)
    if model.spec.enable_confidence_head:
        conf = model.confidence_head(h_nH, emb)
    else:
        conf = torch.zeros(h_nH.shape[:-1], dtype=torch.float32, device=h_nH.device)
    w = weights_K.float().to(h_nH.device)[slot_n]
    share = w / w.sum().clamp(min=torch.finfo(w.dtype).tiny)
    call = HeadLossCall(
        target=target,
        labels=labels_n,
        w_ce=mix[0] * share,
        w_l1=mix[1] * share,
        extra=(emb, model.markov_head.markov_w2.weight),
    )
    if outside_n is None:
        out = model.lm_head.fused_loss(h_nH, call)
    else:
        out = model.lm_head.fused_loss_with_outside(h_nH, call, outside_n)
    accept = (1.0 - 0.5 * out.l1).clamp(0.0, 1.0)
    bce = F.binary_cross_entropy_with_logits(conf.float(), accept, reduction="none")
    count = torch.bincount(slot_n, minlength=weights_K.numel())
    row_loss = (mix[0] * out.ce + mix[1] * out.l1 + mix[2] * bce).detach()
    return StepLoss(
        total=out.loss + mix[2] * _weighted_mean(bce, w),
        step_loss=_per_slot(row_loss, slot_n, count),
        step_acc=_per_slot(out.hit.float(), slot_n, count),
        step_count=count,
    )


def dspark_loss(
    logits_BNKV: torch.Tensor,
    conf_logit_BNK: torch.Tensor,
    target_logp_BNKV: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor,
    weights_K: torch.Tensor,
    mix: tuple[float, float, float] = DEFAULT_MIX,
) -> StepLoss:
    """The DSpark loss over whole blocks: `labels` `[B, N, K]` (output-vocabulary ids; anything where
    invalid), `valid` `[B, N, K]` bool; the other shapes as named. See `dspark_rows`."""
    K = weights_K.numel()
    if logits_BNKV.shape[:-1] != valid.shape or labels.shape != valid.shape or valid.shape[-1] != K:
        raise ValueError(
            f"dspark_loss: logits {tuple(logits_BNKV.shape)}, labels {tuple(labels.shape)}, valid "
            f"{tuple(valid.shape)} and weights_K ({K}) disagree on [B, N, K]"
        )
    valid = valid.bool()
    slot = torch.arange(K, device=valid.device).expand_as(valid)[valid]
    return dspark_rows(
        logits_BNKV[valid], conf_logit_BNK[valid], target_logp_BNKV[valid], labels[valid], slot, weights_K, mix
    )
