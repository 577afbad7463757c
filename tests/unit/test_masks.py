"""Every drafter mask against a loop-by-loop reference written from the spec (algorithms.md §1)."""

import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from draftsmith.drafters import masks

pytestmark = pytest.mark.unit


def _docs() -> torch.Tensor:
    # Row 0: two packed documents then padding; row 1: one document.
    return torch.tensor([[0, 0, 0, 1, 1, -1, -1], [0, 0, 0, 0, 0, 0, 0]])


def _causal_ref(doc, b, q, kv) -> bool:
    return kv <= q and doc[b, q] == doc[b, kv] and doc[b, kv] >= 0


def test_doc_causal_and_sliding_window():
    doc = _docs()
    B, S = doc.shape
    got = masks.dense(masks.doc_causal(doc), B, S, S)
    win = masks.dense(masks.sliding_window(masks.doc_causal(doc), 2), B, S, S)
    for b in range(B):
        for q in range(S):
            for kv in range(S):
                assert got[b, 0, q, kv] == _causal_ref(doc, b, q, kv), (b, q, kv)
                assert win[b, 0, q, kv] == (_causal_ref(doc, b, q, kv) and q - kv < 2), (b, q, kv)
    assert got[0, 0, 3].tolist() == [False, False, False, True, False, False, False]  # a new document starts
    with pytest.raises(ValueError, match="window"):
        masks.sliding_window(masks.doc_causal(doc), 0)


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_ttt_sees_causal_context_plus_its_own_diagonal(depth):
    doc = _docs()
    B, S = doc.shape
    steps = 4
    got = masks.dense(masks.ttt(doc, depth), B, S, steps * S)
    for b in range(B):
        for q in range(S):
            for kv in range(steps * S):
                step, pos = divmod(kv, S)
                want = _causal_ref(doc, b, q, pos) if step == 0 else (pos == q and step <= depth)
                assert got[b, 0, q, kv] == want, (b, q, kv)


def test_dflash_blocks_see_strictly_earlier_context_and_their_own_block():
    ctx, block = 10, 3
    anchors = torch.tensor([[2, 6, 9], [0, 4, 7]])
    keep = torch.tensor([[True, True, False], [True, True, True]])
    B, N = anchors.shape
    Q, K = N * block, ctx + N * block
    got = masks.dense(masks.dflash_blocks(anchors, keep, ctx, block), B, Q, K)
    for b in range(B):
        for q in range(Q):
            n = q // block
            for kv in range(K):
                if not keep[b, n]:
                    want = kv == ctx + q
                elif kv < ctx:
                    want = bool(kv < anchors[b, n])
                else:
                    want = (kv - ctx) // block == n
                assert got[b, 0, q, kv] == want, (b, q, kv)
    assert not got[1, 0, 0, :ctx].any()  # anchor 0: no context before it, only its block


@pytest.mark.parametrize("depth", [1, 2])
def test_anchored_slots_see_context_to_their_anchor_and_their_own_chain(depth):
    ctx = 8
    anchors = torch.tensor([[1, 4, 6], [0, 3, 5]])
    keep = torch.tensor([[True, False, True], [True, True, True]])
    B, N = anchors.shape
    K = ctx + depth * N
    got = masks.dense(masks.anchored_ttt(anchors, keep, ctx, depth), B, N, K)
    for b in range(B):
        for q in range(N):
            for kv in range(K):
                if not keep[b, q]:
                    want = kv == ctx + (depth - 1) * N + q
                elif kv < ctx:
                    want = kv <= anchors[b, q]
                else:
                    want = (kv - ctx) % N == q
                assert got[b, 0, q, kv] == want, (b, q, kv)


def test_flex_attention_with_the_block_mask_equals_sdpa_with_the_dense_mask():
    ctx, block = 16, 4
    anchors = torch.tensor([[3, 9, 14], [5, 6, 12]])
    keep = torch.ones_like(anchors, dtype=torch.bool)
    mod = masks.dflash_blocks(anchors, keep, ctx, block)
    B, N = anchors.shape
    Q, K = N * block, ctx + N * block
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, 2, n, 8, generator=g) for n in (Q, K, K))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=masks.dense(mod, B, Q, K))
    with warnings.catch_warnings():  # eager flex attention warns (once) that it is unfused; expected on CPU
        warnings.simplefilter("ignore", UserWarning)
        out = flex_attention(q, k, v, block_mask=masks.block_mask(mod, B, Q, K))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
