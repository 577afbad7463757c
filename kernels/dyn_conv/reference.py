"""The PyTorch reference of DFlash2's dynamic depthwise convolution over block positions.

Shape legend: R rows (batch x Q queries), H channels, T taps, G channel groups (H = G * group size).
"""

import torch
from torch import nn


def dyn_conv_reference(
    x_RH: torch.Tensor, base_TH: torch.Tensor, delta_RTG: torch.Tensor, block_size: int, seq_len: int
) -> torch.Tensor:
    """`[R, H]`: `out[t, c] = sum_j [pos(t) >= j] (base[j, c] + delta[t, j, group(c)]) * x[t - j, c]`,
    pos(t) = (t mod seq_len) mod block_size, so no tap reaches across a block (or sequence) boundary."""
    R, H = x_RH.shape
    T, G = delta_RTG.shape[1], delta_RTG.shape[2]
    x = x_RH.view(R, G, H // G)
    coef = base_TH.view(1, T, G, H // G) + delta_RTG[..., None]
    pos = torch.arange(R, device=x_RH.device) % seq_len % block_size
    out = coef[:, 0] * x
    for j in range(1, T):
        shifted = nn.functional.pad(x[:-j], (0, 0, 0, 0, j, 0))
        out = out + coef[:, j] * shifted * (pos >= j).view(R, 1, 1)
    return out.reshape(R, H)
