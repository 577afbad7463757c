"""The PyTorch reference of (multi-segment) RMSNorm, as `draftsmith.drafters.layers.RMSNorm` computes it.

Shape legend: R rows, n segments (taps), H segment width.
"""

import torch


def rms_norm_reference(x_RnH: torch.Tensor, weight_nH: torch.Tensor, eps: float) -> torch.Tensor:
    """`[R, n*H]`: each H-wide segment normalised by its own RMS (fp32) and scaled by its weight row."""
    R, n, H = x_RnH.shape[0], weight_nH.shape[0], weight_nH.shape[1]
    x32 = x_RnH.float().view(R, n, H)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight_nH.float() * x32).to(x_RnH.dtype).view(R, n * H)
