"""The Triton path of (multi-segment) RMSNorm as an `autograd.Function`.

Shape legend: R rows, n segments, H segment width, P row blocks.
"""

import torch
import triton

from draftsmith.kernels.dispatch import interpreting
from draftsmith.kernels.rmsnorm.triton_kernels import rms_bwd_kernel, rms_fwd_kernel


def _block_r() -> int:
    return 16 if interpreting() else 4  # the interpreter pays per program


def _block_h(H: int) -> int:
    return min(1024, triton.next_power_of_2(H))


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RnH, weight_nH, eps):
        R = x_RnH.shape[0]
        n, H = weight_nH.shape
        x = x_RnH.contiguous()
        w = weight_nH.contiguous()
        y = torch.empty_like(x)
        rstd = torch.empty(R, n, dtype=torch.float32, device=x.device)
        block_r = _block_r()
        grid = (triton.cdiv(R, block_r), n)
        rms_fwd_kernel[grid](x, w, y, rstd, R, H, n, eps, BLOCK_R=block_r, BLOCK_H=_block_h(H))
        ctx.save_for_backward(x, w, rstd)
        return y

    @staticmethod
    def backward(ctx, dy_RnH):
        x, w, rstd = ctx.saved_tensors
        R = x.shape[0]
        n, H = w.shape
        dy = dy_RnH.contiguous()
        dx = torch.empty_like(x)
        block_r = _block_r()
        blocks = triton.cdiv(R, block_r)
        dw_partial = torch.empty(blocks, n * H, dtype=torch.float32, device=x.device)
        rms_bwd_kernel[(blocks, n)](x, w, dy, rstd, dx, dw_partial, R, H, n, BLOCK_R=block_r, BLOCK_H=_block_h(H))
        dw = dw_partial.sum(0).view(n, H).to(w.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw, None
