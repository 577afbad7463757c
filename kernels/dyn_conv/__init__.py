"""DFlash2's dynamic depthwise convolution (two taps in DFlash2), zero across block boundaries.

Shape legend: B batch, Q queries, H channels, T taps, G channel groups.
"""

import torch

from draftsmith.kernels import dispatch
from draftsmith.kernels.dyn_conv.reference import dyn_conv_reference


def dyn_conv(
    x_BQH: torch.Tensor,
    base_TH: torch.Tensor,
    delta_BQTG: torch.Tensor,
    block_size: int,
    *,
    mode: str | None = None,
) -> torch.Tensor:
    """`[B, Q, H]`: `out[t, c] = sum_j [pos(t) >= j] (base[j, c] + delta[t, j, c // (H/G)]) * x[t - j, c]`,
    pos(t) = t mod block_size (queries are laid out block after block; a last partial block is fine). `base_TH`
    is the static per-channel kernel, `delta_BQTG` the content-adaptive correction per group of H/G channels
    (any strides; a slice of the projection's `[B, Q, 2, T, G]` output is read in place). The Triton path
    needs a power-of-two group size (DFlash2: 16); other sizes run the reference."""
    B, Q, H = x_BQH.shape
    T, G = delta_BQTG.shape[2], delta_BQTG.shape[3]
    if base_TH.shape != (T, H) or delta_BQTG.shape[:2] != (B, Q) or H % G:
        raise ValueError(
            f"dyn_conv: x {tuple(x_BQH.shape)}, base {tuple(base_TH.shape)} and delta {tuple(delta_BQTG.shape)} "
            "are not [B, Q, H], [T, H], [B, Q, T, G] with G dividing H"
        )
    gs = H // G
    x = x_BQH.reshape(B * Q, H)
    delta = delta_BQTG.reshape(B * Q, T, G)
    pow2 = gs & (gs - 1) == 0
    if not pow2 or dispatch.choose("dyn_conv", x.device, mode) == "reference":
        return dyn_conv_reference(x, base_TH, delta, block_size, Q).view(B, Q, H)
    from draftsmith.kernels.dyn_conv.function import DynConvFunction

    return DynConvFunction.apply(x, base_TH, delta, block_size, Q, gs).view(B, Q, H)


__all__ = ["dyn_conv", "dyn_conv_reference"]
