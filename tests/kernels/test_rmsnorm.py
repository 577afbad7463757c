"""RMSNorm kernel (interpreter) against the reference: one segment and three (EAGLE-3.1 `fc_norm`), odd sizes."""

import pytest
import torch
from torch.testing import assert_close

from draftsmith.drafters.layers import RMSNorm, multi_rms_norm
from draftsmith.kernels.rmsnorm import rms_norm
from tests.support import kernels as tol

pytestmark = pytest.mark.unit

H, EPS = 72, 1e-5


def _case(n: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(3, 21, n * H, generator=g) * 3).to(dtype)  # 63 rows
    w = 1 + 0.3 * torch.randn(n, H, generator=g)
    dy = torch.randn(3, 21, n * H, generator=g).to(dtype)
    return x, w, dy


def _grads(x, w, dy, mode):
    x = x.detach().requires_grad_(True)
    w = w.detach().requires_grad_(True)
    y = rms_norm(x, w, EPS, mode=mode)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_forward_and_gradients_match_the_reference(interpreter, poisoned_empty, n, dtype):
    x, w, dy = _case(n, dtype)
    y, dx, dw = _grads(x, w, dy, "triton")
    # The reference in fp32 on the very same (upcast) inputs: the exact value the kernel's fp32 math rounds.
    ry, rdx, rdw = _grads(x.float(), w, dy.float(), "reference")
    store = tol.FP32 if dtype == torch.float32 else tol.STORE[str(dtype).removeprefix("torch.")]
    assert y.dtype == dtype and dx.dtype == dtype
    assert_close(y.float(), ry, **store)
    assert_close(dx.float(), rdx, **store)
    assert_close(dw, rdw, **tol.FP32)  # fp32 sums of exactly-loaded products in both


def test_segments_are_normalised_alone_like_the_module(interpreter):
    """The fused multi-segment form equals one `draftsmith.drafters.layers.RMSNorm` per tap, then the concatenation."""
    x, w, _ = _case(3, torch.float32)
    each = [RMSNorm(H, EPS) for _ in range(3)]
    norms = torch.nn.ModuleList(each)
    with torch.no_grad():
        for norm, row in zip(each, w, strict=True):
            norm.weight.copy_(row)
        per_tap = torch.cat([norm(p) for norm, p in zip(norms, x.chunk(3, dim=-1), strict=True)], dim=-1)
        assert_close(multi_rms_norm(norms, x), per_tap, rtol=0, atol=0)  # CPU default: the reference, bit-exact
        assert_close(rms_norm(x, w, EPS, mode="triton"), per_tap, **tol.FP32)


def test_a_width_that_is_not_segments_times_h_is_an_error():
    with pytest.raises(ValueError, match="rms_norm: x's last dim 100 is not segments \\(3\\) x width \\(72\\)"):
        rms_norm(torch.zeros(2, 100), torch.ones(3, H), EPS)
