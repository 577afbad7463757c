"""DSpark's full-vocabulary target on a pruned head (`outside_column`): the Triton head loss (interpreter) equals
the reference on the extra column, in total, per-slot figures and every gradient."""

import pytest
import torch
from torch.testing import assert_close

from draftsmith import kernels
from draftsmith.drafters.dflash.loss import slot_weights
from draftsmith.drafters.dspark.loss import dspark_rows_fused, outside_logsumexp
from draftsmith.kernels import Target
from tests.support import kernels as tol
from tests.support.models import DSPARK_HT as HT
from tests.support.models import DSPARK_K as K
from tests.support.models import DSPARK_V as V
from tests.support.models import ODD_D2T, ODD_T2D, dspark_drafter

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


def test_dspark_full_vocabulary_target_triton_equals_reference(interpreter):
    model = dspark_drafter(seed=2, draft_vocab_size=24)
    model.d2t.copy_(ODD_D2T)
    model.t2d.copy_(ODD_T2D)
    g = torch.Generator().manual_seed(2)
    h = torch.randn(N, model.spec.hidden_size, generator=g, requires_grad=True)
    prev = torch.randint(0, V, (N,), generator=g)
    head, last = 2.0 * torch.randn(V, HT, generator=g), torch.randn(N, HT, generator=g)
    labels, slots = torch.randint(0, 24, (N,), generator=g), torch.randint(0, K, (N,), generator=g)
    weights, kept = slot_weights(K, 4.0, True), torch.arange(24) + ODD_D2T
    outside = outside_logsumexp(last, head, model.t2d)

    def run(mode: str, outside_n):
        with kernels.use(mode):
            target = Target(hidden=last, head=head[kept])
            return dspark_rows_fused(model, h, prev, target, labels, slots, weights, outside_n=outside_n)

    ref, got = _grads(model, h, lambda: run("reference", outside)), _grads(model, h, lambda: run("triton", outside))
    assert "lm_head.weight" in got[1] and "markov_head.markov_w2.weight" in got[1]
    _same(got, ref)
    renormalised = _grads(model, h, lambda: run("reference", None))
    assert float(ref[0].total) > float(renormalised[0].total) + 1e-3  # the outside mass is counted
