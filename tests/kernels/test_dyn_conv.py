"""DFlash2 dynamic conv kernel (interpreter) against the reference: a last partial block, odd width, strided delta."""

import pytest
import torch
from torch.testing import assert_close

from draftsmith.drafters.dflash.layers import GroupedConv
from draftsmith.kernels.dyn_conv import dyn_conv
from tests.support import kernels as tol

pytestmark = pytest.mark.unit

B, Q, H, G, BLOCK = 2, 21, 72, 9, 8  # Q = 2 whole blocks + 5: the last block is partial; groups of 8


def _case(taps: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(taps)
    x = torch.randn(B, Q, H, generator=g).to(dtype)
    base = torch.randn(taps, H, generator=g)
    full = torch.randn(B, Q, 2, taps, G, generator=g).to(dtype)  # both sides, as kernel_projection makes them
    dy = torch.randn(B, Q, H, generator=g).to(dtype)
    return x, base, full, dy


def _run(x, base, full, dy, mode):
    x, base, full = (t.detach().requires_grad_(True) for t in (x, base, full))
    y = dyn_conv(x, base.to(x.dtype), full[:, :, 1], BLOCK, mode=mode)  # side 1: a strided view
    y.backward(dy)
    return y.detach(), x.grad, base.grad, full.grad


@pytest.mark.parametrize(
    ("taps", "dtype"), [(2, torch.float32), (3, torch.float32), (2, torch.float16), (2, torch.bfloat16)]
)
def test_forward_and_gradients_match_the_reference(interpreter, poisoned_empty, taps, dtype):
    x, base, full, dy = _case(taps, dtype)
    got = _run(x, base, full, dy, "triton")
    ref = _run(x.float(), base, full.float(), dy.float(), "reference")  # exact values of the same inputs
    store = tol.FP32 if dtype == torch.float32 else tol.STORE[str(dtype).removeprefix("torch.")]
    for name, a, b in zip(("y", "dx", "dbase", "ddelta"), got, ref, strict=True):
        assert not a.isnan().any(), name
        scale = max(1.0, float(b.abs().max()))
        assert_close(a.float(), b, rtol=store["rtol"], atol=store["atol"] * scale, msg=name)
    assert torch.equal(got[3][:, :, 0], torch.zeros_like(got[3][:, :, 0]))  # side 0 untouched


def test_nothing_crosses_a_block_boundary(interpreter):
    x, base, full, _ = _case(2, torch.float32)
    y = dyn_conv(x, base, full[:, :, 0], BLOCK, mode="triton")
    bumped = x.clone()
    bumped[:, BLOCK - 1] += 100.0  # the last row of block 0
    y2 = dyn_conv(bumped, base, full[:, :, 0], BLOCK, mode="triton")
    assert torch.equal(y2[:, BLOCK:], y[:, BLOCK:])
    assert not torch.equal(y2[:, BLOCK - 1], y[:, BLOCK - 1])


def test_grouped_conv_layer_runs_the_kernel_like_the_reference(interpreter):
    """`GroupedConv` (what DFlash2 layers call) gives the same output on both paths once trained away from
    its identity init."""
    conv = GroupedConv(H, 2, H // G, BLOCK)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_(std=0.1)
    x = torch.randn(B, Q, H)
    from draftsmith import kernels

    outs = []
    for mode in ("reference", "triton"):
        with kernels.use(mode):
            h, delta = conv.prepare(x)
            outs.append(conv.finish(h, delta))
    assert_close(outs[1], outs[0], **tol.FP32)
