"""RMSNorm, plain or over n equal segments of the last dim fused with their concatenation (`fc_norm`).

Shape legend: `...` leading dims, n segments (taps), H segment width.
"""

import torch

from draftsmith.kernels import dispatch
from draftsmith.kernels.rmsnorm.reference import rms_norm_reference


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, mode: str | None = None) -> torch.Tensor:
    """RMSNorm of `x` `[..., n*H]`, segment i normalised alone and scaled by `weight[i]`; `weight` is `[H]`
    (one segment) or `[n, H]`. Returns `[..., n*H]` in x's dtype, computed in fp32 (as `drafters.layers.RMSNorm`).
    The multi-segment form is EAGLE-3.1's per-tap `fc_norm` followed by the concatenation, in one pass."""
    w = weight.view(1, -1) if weight.dim() == 1 else weight
    n, H = w.shape
    if x.shape[-1] != n * H:
        raise ValueError(f"rms_norm: x's last dim {x.shape[-1]} is not segments ({n}) x width ({H})")
    rows = x.reshape(-1, n * H)
    if dispatch.choose("rms_norm", x.device, mode) == "reference":
        return rms_norm_reference(rows, w, eps).view(x.shape)
    from draftsmith.kernels.rmsnorm.function import RMSNormFunction

    return RMSNormFunction.apply(rows, w, eps).view(x.shape)


__all__ = ["rms_norm", "rms_norm_reference"]
