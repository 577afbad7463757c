"""Fused head loss: the Triton kernel (interpreter) against the PyTorch reference, forward and gradients.

Odd shapes on purpose: T = 63 rows in chunks of 20, V = 300 in vocabulary tiles of 64 (neither divides),
D = 72; the target as logits, as hidden states + head, and as top-5; fp32, fp16 and bf16 inputs.
"""

import pytest
import torch
from torch.testing import assert_close

from draftsmith.kernels.head_loss import Target, head_loss, head_loss_reference
from draftsmith.kernels.head_loss.spec import row_weights
from tests.support.kernels import HEAD_CHUNK_ROWS as CHUNK_ROWS
from tests.support.kernels import HEAD_D as D
from tests.support.kernels import HEAD_T as T
from tests.support.kernels import HEAD_V as V
from tests.support.kernels import compare_head_loss, head_inputs, run_head_loss

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("dtype", "form"),
    [
        (torch.float32, "logits"),
        (torch.float32, "hidden"),
        (torch.float32, "topk"),
        (torch.float16, "hidden"),
        (torch.bfloat16, "hidden"),
    ],
)
def test_dspark_terms_with_markov_extra_match_the_reference(interpreter, poisoned_empty, dtype, form):
    """Every term at once (soft CE + CE + L1, per-row weights) plus the low-rank extra logits term."""
    inputs = head_inputs(dtype, form, extra=True)
    ref = run_head_loss("reference", inputs, soft=True, ce=True, l1=True)
    fused = run_head_loss("triton", inputs, soft=True, ce=True, l1=True)
    compare_head_loss(ref, fused, dtype)
    assert 0 < int(ref[0].acc.sum()) < T or form == "topk"  # the accuracy check saw both outcomes


def test_eagle3_soft_ce_only(interpreter, poisoned_empty):
    inputs = head_inputs(torch.float32, "hidden", extra=False)
    ref = run_head_loss("reference", inputs, soft=True, ce=False, l1=False)
    fused = run_head_loss("triton", inputs, soft=True, ce=False, l1=False)
    compare_head_loss(ref, fused, torch.float32)
    assert fused[0].ce is None and fused[0].l1 is None


def test_dflash_ce_with_a_frozen_head(interpreter, poisoned_empty):
    inputs = head_inputs(torch.float16, None, extra=False, frozen_weight=True)
    ref = run_head_loss("reference", inputs, soft=False, ce=True, l1=False)
    fused = run_head_loss("triton", inputs, soft=False, ce=True, l1=False)
    compare_head_loss(ref, fused, torch.float16)
    assert fused[0].soft_ce is None and fused[0].acc is None and inputs[1].grad is None


def test_no_rows_gives_a_zero_loss_still_in_the_graph(interpreter):
    x = torch.zeros(0, D, requires_grad=True)
    w = torch.randn(V, D, requires_grad=True)
    for mode in ("reference", "triton"):
        out = head_loss(x, w, labels=torch.zeros(0, dtype=torch.long), w_ce=torch.zeros(0), mode=mode)
        out.loss.backward()
        assert out.ce is not None and w.grad is not None
        assert float(out.loss.detach()) == 0.0 and out.ce.shape == (0,)
        assert torch.equal(w.grad, torch.zeros_like(w))


def test_chunked_reference_equals_the_naive_one():
    """The chunked (checkpointed) reference is what CPU training runs; it must be the naive loss exactly."""
    x, w, x2, w2, target, labels, (ws, wc, wl) = head_inputs(torch.float32, "hidden", extra=True)
    w3 = row_weights(T, x.device, ws, wc, wl)
    results = []
    for rows in (None, CHUNK_ROWS):
        for t in (x, w, x2, w2):
            t.grad = None
        out = head_loss_reference(x, w, target, labels, w3, True, x2, w2, chunk_rows=rows)
        out.loss.backward()
        results.append((out, [t.grad.clone() for t in (x, w, x2, w2)]))
    compare_head_loss(results[0], results[1], torch.float32)


def test_the_loss_is_the_textbook_formula_on_a_hand_case():
    """Two rows, three ids: soft CE, CE and L1 worked out from softmax by hand."""
    x = torch.eye(3)[:2]  # rows pick weight columns: z = W[:, :2].T
    w = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [2.0, 0.0, 0.0]])
    zt = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    out = head_loss(x, w, target=Target(logits=zt), labels=torch.tensor([2, 0]), w_soft=torch.ones(2), mode="reference")
    z = x @ w.T  # row 0: [0, 0, 2]; row 1: [1, 0, 0]
    logp_d, p_t = z.log_softmax(-1), zt.softmax(-1)
    assert_close(out.soft_ce, -(p_t * logp_d).sum(-1))
    assert_close(out.ce, -logp_d[[0, 1], [2, 0]])
    assert out.acc is not None and out.hit is not None and out.soft_ce is not None
    assert out.acc.tolist() == [False, True] and out.hit.tolist() == [True, True]
    assert_close(out.loss, out.soft_ce.sum())


@pytest.mark.parametrize(
    ("V", "itemsize", "rows"),
    [(163840, 4, 384), (163840, 2, 768), (49152, 4, 1280), (4096, 4, 16384), (300000, 4, 128), (1 << 20, 4, 64)],
)
def test_row_chunks_fill_whole_matrix_tiles_within_the_budget(V, itemsize, rows):
    from draftsmith.kernels.head_loss import DEFAULT_BUDGET, chunk_rows_for

    assert chunk_rows_for(V, itemsize) == rows
    assert rows * V * itemsize <= DEFAULT_BUDGET
    assert chunk_rows_for(1 << 27) == 1  # a row bigger than the budget still makes progress
