"""Fused output head + distillation loss: `x @ W.T` -> softmax -> loss terms, never all `[T, V]` at once.

Shape legend: T rows, D drafter width, V output vocabulary, r extra (Markov) rank.
"""

import torch

from draftsmith.kernels import dispatch
from draftsmith.kernels.head_loss.eager import head_loss_eager
from draftsmith.kernels.head_loss.reference import head_loss_reference
from draftsmith.kernels.head_loss.spec import HeadLossOut, Target, row_weights

# Bytes of one chunk's `[C, V]` logits buffer (256 MiB): C = budget // (V * itemsize) rows per chunk. The kernel
# holds the logits in the training dtype (bf16: twice the rows of fp32); the eager path widens them to fp32.
DEFAULT_BUDGET = 1 << 28
# Matrix units work in tiles of 128 rows (64 on older GPUs): a chunk of 409 rows (Kimi K3's V = 163840 in fp32)
# runs 4 tiles a chunk, 81 for 8192 rows against 64 with chunks of 384, in each of the chunk's matmuls.
ROW_ALIGN = 128


def chunk_rows_for(V: int, itemsize: int = 4, budget: int = DEFAULT_BUDGET) -> int:
    """Rows per chunk: as many `[V]` rows of `itemsize`-byte logits as fit `budget` bytes, rounded down to a
    multiple of `ROW_ALIGN`."""
    rows = max(1, budget // max(V * itemsize, 1))
    return rows - rows % ROW_ALIGN if rows >= ROW_ALIGN else rows


def _check(x_TD, weight_VD, labels_T, extra) -> None:
    if x_TD.dim() != 2 or weight_VD.dim() != 2 or x_TD.shape[1] != weight_VD.shape[1]:
        raise ValueError(f"head_loss: x {tuple(x_TD.shape)} and weight {tuple(weight_VD.shape)} are not [T, D], [V, D]")
    if labels_T is not None and labels_T.shape != (x_TD.shape[0],):
        raise ValueError(f"head_loss.labels: shape {tuple(labels_T.shape)}, expected ({x_TD.shape[0]},)")
    if extra is not None:
        ex, ew = extra
        if ex.shape[0] != x_TD.shape[0] or ew.shape[0] != weight_VD.shape[0] or ex.shape[1] != ew.shape[1]:
            raise ValueError(
                f"head_loss.extra: x2 {tuple(ex.shape)} and W2 {tuple(ew.shape)} are not [T, r], [V, r] "
                f"for T={x_TD.shape[0]}, V={weight_VD.shape[0]}"
            )


def head_loss(
    x_TD: torch.Tensor,
    weight_VD: torch.Tensor,
    *,
    target: Target | None = None,
    labels: torch.Tensor | None = None,
    w_soft: torch.Tensor | None = None,
    w_ce: torch.Tensor | None = None,
    w_l1: torch.Tensor | None = None,
    extra: tuple[torch.Tensor, torch.Tensor] | None = None,
    chunk_rows: int | None = None,
    block_v: int | None = None,
    mode: str | None = None,
) -> HeadLossOut:
    """The weighted head loss `sum_t w_soft*soft_ce + w_ce*ce + w_l1*l1` over draft logits
    `z = x @ W.T (+ x2 @ W2.T)`, with per-row terms and accuracies (`HeadLossOut`).

    Args:
        x_TD: drafter rows after the final norm `[T, D]`.
        weight_VD: the (pruned) lm_head weight `[V, D]`.
        target: the target distribution `Target` (needed for soft CE, L1 and `acc`).
        labels: gold ids `[T]` in `[0, V)` (needed for CE and `hit`).
        w_soft, w_ce, w_l1: per-row weights `[T]` of soft CE (forward KL up to the target's entropy), CE and
            L1; L1 is computed only when `w_l1` is given.
        extra: `(x2 [T, r], W2 [V, r])` added to the logits (DSpark's Markov bias), differentiable too.
        chunk_rows: rows per chunk (default: `chunk_rows_for`, a `DEFAULT_BUDGET` buffer of the path's logits);
            block_v: kernel tile width.
        mode: `auto` / `reference` / `triton` (default: the process mode, `kernels.dispatch`); `auto` runs the
            kernel on CUDA and `eager.head_loss_eager` (the same gradients, made in forward) elsewhere.
    """
    _check(x_TD, weight_VD, labels, extra)
    T, V = x_TD.shape[0], weight_VD.shape[0]
    if target is not None:
        target.check(T, V)
    x_TD = x_TD.to(weight_VD.dtype)
    w3 = row_weights(T, x_TD.device, w_soft, w_ce, w_l1)
    need_l1 = w_l1 is not None
    ex, ew = extra if extra is not None else (None, None)
    if ex is not None and ew is not None:
        ex = ex.to(ew.dtype)
    if dispatch.choose("head_loss", x_TD.device, mode) == "reference":
        rows = chunk_rows or chunk_rows_for(V)
        # `auto` without the kernel (CPU) runs the same loss with its gradient made in forward (`eager`); an
        # explicit `reference`, and a step without autograd, run plain autograd over the reference.
        if (mode or dispatch.get_mode()) == "reference" or not torch.is_grad_enabled():
            return head_loss_reference(x_TD, weight_VD, target, labels, w3, need_l1, ex, ew, rows)
        return head_loss_eager(x_TD, weight_VD, target, labels, w3, need_l1, ex, ew, rows)
    from draftsmith.kernels.head_loss.function import head_loss_triton

    bv = block_v or min(1024, max(16, 1 << (V - 1).bit_length()))
    rows = chunk_rows or chunk_rows_for(V, x_TD.element_size())
    return head_loss_triton(x_TD, weight_VD, target, labels, w3, need_l1, ex, ew, rows, bv)


__all__ = ["HeadLossOut", "Target", "head_loss", "head_loss_eager", "head_loss_reference"]
