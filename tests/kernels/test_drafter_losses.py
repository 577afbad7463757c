"""The drafters' fused loss paths (Triton kernels, interpreter) equal their logits-based originals.

EAGLE-3 `ttt_loss_fused` vs `ttt_loss`, DSpark `dspark_rows_fused` (Markov term as the extra low-rank logits)
vs `dspark_rows`, DFlash `slot_ce_fused` vs `slot_ce`: totals, per-slot figures and every gradient.
"""

import pytest
import torch
from torch.testing import assert_close

from draftsmith import kernels
from draftsmith.drafters.dflash.loss import slot_ce, slot_ce_fused, slot_weights
from draftsmith.drafters.dspark.loss import dspark_rows, dspark_rows_fused, target_logp
from draftsmith.drafters.eagle3.loss import position_mask, ttt_loss, ttt_loss_fused
from draftsmith.kernels import Target
from tests.support import kernels as tol
from tests.support.models import DSPARK_HT as HT
from tests.support.models import DSPARK_K as K
from tests.support.models import DSPARK_V as V
from tests.support.models import dspark_drafter, eagle3_drafter

pytestmark = pytest.mark.unit

N = 45  # counted rows


def _grads(model, h, fn):
    model.zero_grad()
    h.grad = None
    out = fn()
    out.total.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return out, grads | {"h": h.grad.clone()}


def _same(a, b) -> None:
    (out_a, grads_a), (out_b, grads_b) = a, b
    for field in ("total", "step_loss", "step_acc", "step_count"):
        assert_close(getattr(out_a, field), getattr(out_b, field), **tol.FP32, msg=field)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        assert_close(grads_a[name], grads_b[name], **tol.FP32, msg=name)


def test_dspark_fused_rows_equal_the_logits_path(interpreter):
    model = dspark_drafter(seed=0)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, model.spec.hidden_size, generator=g, requires_grad=True)
    prev = torch.randint(0, V, (N,), generator=g)
    head, last = torch.randn(V, HT, generator=g), torch.randn(N, HT, generator=g)
    labels, slots = torch.randint(0, V, (N,), generator=g), torch.randint(0, K, (N,), generator=g)
    weights = slot_weights(K, 4.0, True)

    def original():
        logits, conf, _ = model.heads(h, prev)
        return dspark_rows(logits, conf, target_logp(head, last), labels, slots, weights)

    def fused():
        with kernels.use("triton"):
            return dspark_rows_fused(model, h, prev, Target(hidden=last, head=head), labels, slots, weights)

    ref, got = _grads(model, h, original), _grads(model, h, fused)
    assert "markov_head.markov_w2.weight" in got[1] and "confidence_head.proj.weight" in got[1]
    _same(got, ref)


def test_dflash_fused_ce_equals_the_logits_path(interpreter):
    model = dspark_drafter(seed=1)
    g = torch.Generator().manual_seed(1)
    h = torch.randn(N, model.spec.hidden_size, generator=g, requires_grad=True)
    labels, slots = torch.randint(0, V, (N,), generator=g), torch.randint(1, K, (N,), generator=g)
    weights = slot_weights(K, 7.0, False)
    ref = _grads(model, h, lambda: slot_ce(model.logits(h), labels, slots, weights))
    with kernels.use("triton"):
        got = _grads(model, h, lambda: slot_ce_fused(model, h, labels, slots, weights))
    _same(got, ref)


def test_eagle3_fused_ttt_equals_the_logits_path(interpreter):
    model = eagle3_drafter(norm_output=True, fc_norm=True).train()
    B, S, H = 2, 12, model.spec.hidden_size
    g = torch.Generator().manual_seed(2)
    h = torch.randn(B, S, H, generator=g, requires_grad=True)

    def steps():  # built inside each run: the two runs backpropagate separately
        return [h, 0.5 * h + 1.0, h.tanh()]

    mask = position_mask(torch.rand(B, S, generator=g) > 0.3, torch.ones(B, S, dtype=torch.bool))
    head = torch.randn(model.spec.draft_vocab_size, 24, generator=g)
    last = torch.randn(int(mask.sum()), 24, generator=g)
    ref = _grads(model, h, lambda: ttt_loss(model.logits, steps(), (last @ head.T).log_softmax(-1), mask, 0.8))
    with kernels.use("triton"):
        got = _grads(model, h, lambda: ttt_loss_fused(model, steps(), last, head, mask, 0.8))
    _same(got, ref)


def test_eagle3_fused_anchored_loss_equals_the_logits_path(interpreter):
    """The Kimi K3 EAGLE-3 recipe trains anchored: its loss goes through the fused head too."""
    from draftsmith.drafters.anchors import strided_anchors
    from draftsmith.drafters.eagle3.anchored import anchored_hidden, anchored_loss, anchored_loss_fused
    from tests.support.models import TTT_DEPTH as DEPTH
    from tests.support.models import ttt_batch

    model = eagle3_drafter(norm_output=True, fc_norm=True).train()
    ids, feats, loss_mask, in_draft, last, head = ttt_batch(seed=3)
    mask = position_mask(loss_mask, in_draft)
    anchors, keep = strided_anchors(mask, 5, DEPTH, max_gap=2, generator=torch.Generator().manual_seed(4))
    h = feats.clone().requires_grad_(True)

    def run(loss_fn):
        hidden = anchored_hidden(model, ids, h, anchors, keep, DEPTH)
        return loss_fn(model, hidden, anchors, keep, last, head, mask, 0.8)

    ref = _grads(model, h, lambda: run(anchored_loss))
    with kernels.use("triton"):
        got = _grads(model, h, lambda: run(anchored_loss_fused))
    assert int(got[0].step_count.sum()) > 0
    _same(got, ref)
