"""The block drafters' split training attention (`drafters.dflash.block_attention`) against the dense form.

The split mask must be the dense training mask in two parts, and the flash + log-sum-exp path must give the
dense SDPA's output and gradients, including rows with no context key (an anchor at position 0, a dropped
slot) and windowed or causal layers.
"""

from typing import Any

import pytest
import torch

from draftsmith.drafters.dflash.block_attention import BlockAttention, block_attention, block_attention_reference
from draftsmith.drafters.dflash.block_masks import split_train_mask, train_mask

pytestmark = pytest.mark.unit

CASES = [(None, False), (3, True), (None, True), (5, False)]


def _anchors():
    # Row 1 has an anchor at 0 (no context before it) and a dropped block.
    return torch.tensor([[1, 4, 9], [0, 6, 2]]), torch.tensor([[True, True, True], [True, False, True]])


@pytest.mark.parametrize(("window", "causal"), CASES)
def test_split_mask_is_the_dense_training_mask(window, causal):
    anchors, keep = _anchors()
    split = split_train_mask(anchors, keep, 14, 4, window, causal)
    assert split.ctx.shape == (2, 1, 12, 14) and split.own.shape == (2, 1, 3, 4, 4)
    assert torch.equal(split.dense(), train_mask(anchors, keep, 14, 4, window, causal))


def _inputs(seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    B, h, S, Q, d = 2, 3, 14, 12, 8
    shapes = [(B, h, Q, d), (B, h, S, d), (B, h, S, d), (B, h, Q, d), (B, h, Q, d)]
    return [(torch.randn(*s, generator=g) * 2).to(dtype).requires_grad_() for s in shapes]


@pytest.mark.parametrize(("window", "causal"), CASES)
def test_flash_merge_equals_dense_attention_and_its_gradients(window, causal):
    anchors, keep = _anchors()
    mask = split_train_mask(anchors, keep, 14, 4, window, causal)
    fast_in, ref_in = _inputs(0), _inputs(0)
    fast = BlockAttention.apply(*fast_in, mask.ctx, mask.own, 0.35)
    q, ck, cv, bk, bv = ref_in
    ref = block_attention_reference(q, ck, cv, bk, bv, mask, 0.35)
    assert torch.allclose(fast, ref, atol=1e-5, rtol=1e-5)
    grad = torch.randn(fast.shape, generator=torch.Generator().manual_seed(1))
    (fast * grad).sum().backward()
    (ref * grad).sum().backward()
    for name, a, b in zip(["q", "ctx_k", "ctx_v", "blk_k", "blk_v"], fast_in, ref_in, strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-4, rtol=1e-4), (name, (a.grad - b.grad).abs().max())
    # A dropped slot sees only itself: its output is its own value.
    assert torch.allclose(fast[1, :, 4:8], ref_in[4][1, :, 4:8], atol=1e-6)


def test_cpu_dispatch_takes_the_flash_path_and_other_widths_the_dense_one(monkeypatch):
    anchors, keep = _anchors()
    mask = split_train_mask(anchors, keep, 14, 4, None, False)
    calls: list[int] = []
    real = BlockAttention.apply

    def counted(*a: Any) -> Any:
        calls.append(1)
        return real(*a)

    monkeypatch.setattr(BlockAttention, "apply", counted)
    q, ck, cv, bk, bv = _inputs(2)
    block_attention(q, ck, cv, bk, bv, mask, 0.35)
    assert calls == [1]
    # Values narrower than the keys (MLA): the kernel needs equal widths, so the dense path runs.
    narrow = block_attention(q, ck, cv[..., :4], bk, bv[..., :4], mask, 0.35)
    assert calls == [1] and narrow.shape == (2, 3, 12, 4)
    assert torch.allclose(narrow, block_attention_reference(q, ck, cv[..., :4], bk, bv[..., :4], mask, 0.35))


def test_bf16_inputs_stay_close_to_the_fp32_result():
    anchors, keep = _anchors()
    mask = split_train_mask(anchors, keep, 14, 4, 3, True)
    x32 = _inputs(3)
    x16 = [t.detach().to(torch.bfloat16) for t in x32]
    out16 = BlockAttention.apply(*x16, mask.ctx, mask.own, 0.35)
    assert out16.dtype == torch.bfloat16
    q, ck, cv, bk, bv = (t.detach() for t in x32)
    ref = block_attention_reference(q, ck, cv, bk, bv, mask, 0.35)
    assert (out16.float() - ref).abs().max() < 0.1
