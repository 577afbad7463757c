"""The fused head loss as an `autograd.Function`: the Triton path, and the chunk loop the eager path shares.

Rows are processed in chunks of C rows (C·V bounded by a memory budget). Per chunk: the draft logits
`[C, V]` (one matmul, in the inputs' dtype as the reference does; widened to fp32 for the eager routine, read
as they are by the kernel, which computes in fp32 and writes `dloss/dz` back in that dtype), the target's logits
for the same rows (a slice, a matmul with the frozen target head, or a top-k scatter), one kernel launch that
computes the per-row terms and turns the logits into `dloss/dz` in place, then `dx = g @ W` and
`dW += g.T @ x`. The gradient is therefore complete when forward returns (the row weights are forward
inputs); backward only scales it by the incoming scalar. Peak extra memory: two `[C, V]` buffers, the
`[V, D]` weight gradient in the weight's dtype and `[T, D]` for dx, never `[T, V]`.

The weight gradient accumulates over the row chunks in the weight's dtype (`addmm`, fp32 inside each matmul,
one rounding per chunk, as Liger's fused linear cross-entropy does): an fp32 accumulator would cost another
`[V, D]` fp32 (4.7 GB at Kimi K3's head), about what the compiled reference holds in logits.

Shape legend: T rows, D drafter width, V output vocabulary, r extra rank, C rows per chunk.
"""

import functools

import torch

from draftsmith.kernels.head_loss.reference import draft_logits
from draftsmith.kernels.head_loss.spec import HeadLossOut, Target


def _launch(z_CV, zt_CV, labels_T, w3_T, out3_T, arg2_T, row0, need_l1, *, block_v):
    import triton

    from draftsmith.kernels.dispatch import interpreting
    from draftsmith.kernels.head_loss.triton_kernels import head_rows_kernel

    C, V = z_CV.shape
    has_t = zt_CV is not None
    zt = zt_CV if has_t else z_CV  # never read without a target
    labels = labels_T if labels_T is not None else arg2_T  # never read without labels
    block_t = 16 if interpreting() else 1  # the interpreter pays per program; a GPU wants one row per program
    head_rows_kernel[(triton.cdiv(C, block_t),)](
        z_CV,
        zt,
        labels,
        w3_T,
        out3_T,
        arg2_T,
        row0,
        C,
        w3_T.shape[1],
        V,
        z_CV.stride(0),
        zt.stride(0),
        HAS_T=has_t,
        HAS_LABEL=labels_T is not None,
        NEED_L1=need_l1 and has_t,
        BLOCK_T=block_t,
        BLOCK_V=block_v,
        num_warps=8 if block_v >= 1024 else 4,
    )


class FusedHeadLoss(torch.autograd.Function):
    """`(loss, out3 [3, T], arg2 [2, T])`; only `loss` is differentiable (see the module docstring)."""

    @staticmethod
    def forward(ctx, x_TD, weight_VD, extra_x, extra_w, target, labels_T, w3_T, need_l1, chunk_rows, launch, widen):
        """`launch(z, zt, labels, w3, out3, arg2, row0, need_l1)` fills a chunk's rows of `out3`/`arg2` and turns
        its logits `z` `[C, V]` into `dloss/dz` in place: the Triton kernel, or `eager.rows_eager`. `widen`: `z`
        is fp32 (the eager routine computes in its input's dtype), else the inputs' dtype (the kernel reads
        and writes it, computing in fp32, which saves two passes over the chunk's logits)."""
        T, V = x_TD.shape[0], weight_VD.shape[0]
        dev = x_TD.device
        out3 = torch.empty(3, T, dtype=torch.float32, device=dev)
        arg2 = torch.empty(2, T, dtype=torch.int64, device=dev)
        gx = torch.empty_like(x_TD) if x_TD.requires_grad else None
        gw = torch.zeros_like(weight_VD) if weight_VD.requires_grad else None
        gx2 = torch.empty_like(extra_x) if extra_x is not None and extra_x.requires_grad else None
        gw2 = torch.zeros_like(extra_w) if extra_w is not None and extra_w.requires_grad else None
        w3 = w3_T.contiguous()
        for r0 in range(0, T, chunk_rows):
            r1 = min(T, r0 + chunk_rows)
            x = x_TD[r0:r1]
            ex = None if extra_x is None else extra_x[r0:r1]
            z = draft_logits(x, weight_VD, ex, extra_w, widen=widen).contiguous()
            zt = None if target is None else target.rows(r0, r1, V).contiguous()
            launch(z, zt, labels_T, w3, out3, arg2, r0, need_l1)
            g = z.to(x.dtype)
            if gx is not None:
                torch.mm(g, weight_VD, out=gx[r0:r1])
            # `addmm(out=)`, not `addmm_`: FlopCounterMode, which the MFU figure reads, skips in-place addmm.
            if gw is not None:
                torch.addmm(gw, g.T, x, out=gw)
            if gx2 is not None:
                torch.mm(g, extra_w, out=gx2[r0:r1])
            if gw2 is not None:
                torch.addmm(gw2, g.T, extra_x[r0:r1], out=gw2)
            del z, zt, g
        ctx.save_for_backward(*[t if t is not None else torch.empty(0) for t in (gx, gw, gx2, gw2)])
        ctx.present = tuple(t is not None for t in (gx, gw, gx2, gw2))
        loss = (w3 * out3).sum()
        ctx.mark_non_differentiable(out3, arg2)
        return loss, out3, arg2

    @staticmethod
    def backward(ctx, grad_loss, _g_out3, _g_arg2):
        grads = [g * grad_loss.to(g.dtype) if p else None for g, p in zip(ctx.saved_tensors, ctx.present, strict=True)]
        return grads[0], grads[1], grads[2], grads[3], None, None, None, None, None, None, None


def head_loss_triton(
    x_TD: torch.Tensor,
    weight_VD: torch.Tensor,
    target: Target | None,
    labels_T: torch.Tensor | None,
    w3_T: torch.Tensor,
    need_l1: bool,
    extra_x_Tr: torch.Tensor | None,
    extra_weight_Vr: torch.Tensor | None,
    chunk_rows: int,
    block_v: int,
) -> HeadLossOut:
    """`HeadLossOut` from the kernel; arguments as `reference.head_loss_reference`."""
    launch = functools.partial(_launch, block_v=block_v)
    return fused_head_loss(
        x_TD, weight_VD, target, labels_T, w3_T, need_l1, extra_x_Tr, extra_weight_Vr, chunk_rows, launch, widen=False
    )


def fused_head_loss(
    x_TD, weight_VD, target, labels_T, w3_T, need_l1, extra_x_Tr, extra_weight_Vr, chunk_rows, launch, *, widen=True
):
    """`HeadLossOut` from `FusedHeadLoss` with a row routine `launch` (see `FusedHeadLoss.forward`)."""
    loss, out3, arg2 = FusedHeadLoss.apply(
        x_TD, weight_VD, extra_x_Tr, extra_weight_Vr, target, labels_T, w3_T, need_l1, max(1, chunk_rows), launch,
        widen,
    )  # fmt: skip
    has_t = target is not None
    return HeadLossOut(
        loss=loss,
        soft_ce=out3[0] if has_t else None,
        ce=out3[1] if labels_T is not None else None,
        l1=out3[2] if need_l1 and has_t else None,
        acc=arg2[0] == arg2[1] if has_t else None,
        hit=arg2[0] == labels_T if labels_T is not None else None,
    )
