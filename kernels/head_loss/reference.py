"""The PyTorch reference of the fused head loss: plain autograd, optionally a chunk of rows at a time.

`chunk_rows=None` is the naive form (all `[T, V]` logits alive through backward). With `chunk_rows`, each
chunk runs under non-reentrant activation checkpointing, so autograd keeps only one chunk's `[C, V]`
tensors alive (its logits are recomputed in backward): the memory figure `benchmarks/kernels.py` reports.

Shape legend: T rows, D drafter width, V output vocabulary, r extra rank, C rows per chunk.
"""

import torch
from torch.utils.checkpoint import checkpoint

from draftsmith.kernels.head_loss.spec import FLOOR, HeadLossOut, Target


def draft_logits(x_TD, weight_VD, extra_x_Tr=None, extra_weight_Vr=None, *, widen: bool = True) -> torch.Tensor:
    """`[T, V]`: `x @ W.T (+ x2 @ W2.T)` in the inputs' dtype, then widened to fp32 (as the drafters' heads do)
    unless `widen` is False."""
    z = x_TD @ weight_VD.T
    if extra_x_Tr is not None:
        z = z + extra_x_Tr @ extra_weight_Vr.T
    return z.float() if widen else z


def _rows(x, weight, extra_x, extra_weight, target_zt, labels, w3, need_l1):
    """One chunk: the weighted loss and the detached per-row terms (see `HeadLossOut`)."""
    logp_d = draft_logits(x, weight, extra_x, extra_weight).log_softmax(-1)
    total = logp_d.new_zeros(())
    soft = ce = l1 = acc = hit = None
    if target_zt is not None:
        zt = target_zt.float()
        logp_t = zt.masked_fill(zt <= FLOOR, float("-inf")).log_softmax(-1)
        p_t = logp_t.exp()
        soft = -(p_t * logp_d).sum(-1)
        total = total + (w3[0] * soft).sum()
        acc = logp_d.argmax(-1) == zt.argmax(-1)
        if need_l1:
            l1 = (logp_d.exp() - p_t).abs().sum(-1)
            total = total + (w3[2] * l1).sum()
    if labels is not None:
        ce = -logp_d.gather(-1, labels[:, None]).squeeze(-1)
        total = total + (w3[1] * ce).sum()
        hit = logp_d.argmax(-1) == labels
    detached = [t.detach() if t is not None else None for t in (soft, ce, l1, acc, hit)]
    return total, *detached


def head_loss_reference(
    x_TD: torch.Tensor,
    weight_VD: torch.Tensor,
    target: Target | None,
    labels_T: torch.Tensor | None,
    w3_T: torch.Tensor,
    need_l1: bool,
    extra_x_Tr: torch.Tensor | None = None,
    extra_weight_Vr: torch.Tensor | None = None,
    chunk_rows: int | None = None,
) -> HeadLossOut:
    """`HeadLossOut` by autograd; `w3_T` `[3, T]` weighs (soft CE, CE, L1) per row (`spec.row_weights`)."""
    T, V = x_TD.shape[0], weight_VD.shape[0]
    step = max(1, T if chunk_rows is None else chunk_rows)
    parts = []
    for r0 in range(0, max(T, 1), step):
        r1 = min(T, r0 + step)
        sl = slice(r0, r1)
        args = (
            x_TD[sl],
            weight_VD,
            None if extra_x_Tr is None else extra_x_Tr[sl],
            extra_weight_Vr,
            None if target is None else target.rows(r0, r1, V),
            None if labels_T is None else labels_T[sl],
            w3_T[:, sl],
            need_l1,
        )
        parts.append(checkpoint(_rows, *args, use_reentrant=False) if step < T else _rows(*args))
    total = sum(p[0] for p in parts)
    cols = [None if parts[0][i] is None else torch.cat([p[i] for p in parts]) for i in range(1, 6)]
    return HeadLossOut(total, *cols)
