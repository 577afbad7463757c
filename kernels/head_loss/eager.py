"""The fused head loss in plain PyTorch ops: what `auto` runs where the Triton kernel does not (CPU).

It shares the Triton path's chunk loop (`function.FusedHeadLoss`): per chunk of rows the logits `[C, V]` are
made once, the per-row terms are read off them, and the buffer is turned into `dloss/dz` in place, so the
gradient matmuls run inside forward and backward only scales their results. Against autograd over
`reference.head_loss_reference` this keeps no `[T, V]` activations for backward and makes about half the
elementwise passes over the logits (a CPU is memory-bound on them). The formulas are the reference's; the
parity tests hold the two to fp32 rounding.

Gradients with respect to the logits z (p_d = softmax z, p_t the target's softmax):
  soft CE  -sum p_t log p_d      -> p_d - p_t
  CE       -log p_d[label]       -> p_d - onehot(label)
  L1       sum |p_d - p_t|       -> p_d * (s - sum_v s_v p_d_v),   s = sign(p_d - p_t)

Shape legend: T rows, C rows of a chunk, V output vocabulary.
"""

import torch

from draftsmith.kernels.head_loss.function import fused_head_loss
from draftsmith.kernels.head_loss.spec import HeadLossOut, Target


def rows_eager(
    z_CV: torch.Tensor,
    zt_CV: torch.Tensor | None,
    labels_T: torch.Tensor | None,
    w3_T: torch.Tensor,
    out3_T: torch.Tensor,
    arg2_T: torch.Tensor,
    row0: int,
    need_l1: bool,
) -> None:
    """One chunk: rows `row0:row0 + C` of `out3` (soft CE, CE, L1) and `arg2` (argmax draft, target), and
    `z_CV` (fp32 logits) overwritten with the gradient of `sum_t w3 . terms` with respect to it."""
    rows = slice(row0, row0 + z_CV.shape[0])
    w_soft, w_ce, w_l1 = (w3_T[i, rows, None] for i in range(3))
    out3_T[:, rows] = 0.0
    arg2_T[:, rows] = 0
    arg2_T[0, rows] = z_CV.argmax(-1)
    logp = z_CV.sub_(torch.logsumexp(z_CV, -1, keepdim=True))  # the buffer now holds log p_d
    p_t = None
    if zt_CV is not None:
        # A top-k target's FLOOR entries need no mask: exp(FLOOR - max) is exactly 0 in fp32.
        p_t = zt_CV.softmax(-1, dtype=torch.float32)
        arg2_T[1, rows] = zt_CV.argmax(-1)
        out3_T[0, rows] = -(p_t * logp).sum(-1)
    if labels_T is not None:
        lab = labels_T[rows, None]
        out3_T[1, rows] = -logp.gather(1, lab).squeeze(1)
    p_d = logp.exp_()
    l1_grad = None
    if need_l1 and p_t is not None:
        diff = p_d - p_t
        out3_T[2, rows] = diff.abs().sum(-1)
        sign = diff.sign_()
        sdot = (sign * p_d).sum(-1, keepdim=True)
        l1_grad = sign.sub_(sdot).mul_(p_d).mul_(w_l1)
    grad = p_d.mul_(w_soft + w_ce)
    if p_t is not None:
        grad.addcmul_(p_t, w_soft, value=-1.0)
    if labels_T is not None:
        grad.scatter_add_(1, lab, -w_ce)
    if l1_grad is not None:
        grad.add_(l1_grad)


def head_loss_eager(
    x_TD: torch.Tensor,
    weight_VD: torch.Tensor,
    target: Target | None,
    labels_T: torch.Tensor | None,
    w3_T: torch.Tensor,
    need_l1: bool,
    extra_x_Tr: torch.Tensor | None,
    extra_weight_Vr: torch.Tensor | None,
    chunk_rows: int,
) -> HeadLossOut:
    """`HeadLossOut` with gradients made in forward; arguments as `reference.head_loss_reference`."""
    return fused_head_loss(
        x_TD, weight_VD, target, labels_T, w3_T, need_l1, extra_x_Tr, extra_weight_Vr, chunk_rows, rows_eager
    )
