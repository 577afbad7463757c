"""The Triton path of the dynamic depthwise convolution as an `autograd.Function`.

Shape legend: R rows, H channels, T taps, G groups, P row blocks.
"""

import torch
import triton

from draftsmith.kernels.dyn_conv.triton_kernels import conv_bwd_kernel, conv_fwd_kernel

BLOCK_R = 16


def _block_c(H: int, group_size: int) -> int:
    return max(group_size, min(128, triton.next_power_of_2(H)))


class DynConvFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RH, base_TH, delta_RTG, block_size, seq_len, group_size):
        R, H = x_RH.shape
        T, G = delta_RTG.shape[1], delta_RTG.shape[2]
        x, base = x_RH.contiguous(), base_TH.contiguous()
        delta = delta_RTG if delta_RTG.stride(2) == 1 else delta_RTG.contiguous()
        y = torch.empty_like(x)
        bc = _block_c(H, group_size)
        grid = (triton.cdiv(R, BLOCK_R), triton.cdiv(H, bc))
        conv_fwd_kernel[grid](
            x, base, delta, y, R, H, G, seq_len, block_size, delta.stride(0), delta.stride(1),
            TAPS=T, GS=group_size, BLOCK_R=BLOCK_R, BLOCK_C=bc,
        )  # fmt: skip
        ctx.save_for_backward(x, base, delta)
        ctx.block_size, ctx.seq_len, ctx.group_size = block_size, seq_len, group_size
        return y

    @staticmethod
    def backward(ctx, dy_RH):
        x, base, delta = ctx.saved_tensors
        R, H = x.shape
        T, G = delta.shape[1], delta.shape[2]
        dy = dy_RH.contiguous()
        bc = _block_c(H, ctx.group_size)
        grid = (triton.cdiv(R, BLOCK_R), triton.cdiv(H, bc))
        dx = torch.empty_like(x)
        ddelta = torch.empty(R, T, G, dtype=torch.float32, device=x.device)
        dbase_partial = torch.empty(grid[0], T, H, dtype=torch.float32, device=x.device)
        conv_bwd_kernel[grid](
            x, base, delta, dy, dx, ddelta, dbase_partial, R, H, G, ctx.seq_len, ctx.block_size,
            delta.stride(0), delta.stride(1),
            TAPS=T, GS=ctx.group_size, BLOCK_R=BLOCK_R, BLOCK_C=bc,
        )  # fmt: skip
        return dx, dbase_partial.sum(0).to(base.dtype), ddelta.to(delta.dtype), None, None, None
