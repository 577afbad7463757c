"""The eager fused head loss (`auto` on CPU: gradients made in forward) against the autograd reference.

Same odd shapes as `test_head_loss` (T = 63 rows in chunks of 20, V = 300, D = 72), every target form and the
DSpark extra term; the eager path must give the reference's loss terms, accuracies and gradients.
"""

import sys

import pytest
import torch

from draftsmith.kernels import dispatch
from draftsmith.kernels.head_loss import head_loss
from tests.support.kernels import HEAD_CHUNK_ROWS as CHUNK_ROWS
from tests.support.kernels import HEAD_D as D
from tests.support.kernels import HEAD_V as V
from tests.support.kernels import compare_head_loss, head_inputs, run_head_loss

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("dtype", "form", "extra"),
    [
        (torch.float32, "logits", True),
        (torch.float32, "hidden", True),
        (torch.float32, "topk", True),
        (torch.float32, "hidden", False),
        (torch.bfloat16, "hidden", True),
    ],
)
def test_every_term_matches_the_reference(poisoned_empty, dtype, form, extra):
    inputs = head_inputs(dtype, form, extra=extra)
    ref = run_head_loss("reference", inputs, soft=True, ce=True, l1=True)
    eager = run_head_loss("auto", inputs, soft=True, ce=True, l1=True)
    compare_head_loss(ref, eager, dtype)


@pytest.mark.parametrize(("soft", "ce"), [(True, False), (False, True)])
def test_single_terms_and_a_frozen_head(poisoned_empty, soft, ce):
    """EAGLE-3's soft CE alone and DFlash's CE alone, the head frozen (no weight gradient is made)."""
    inputs = head_inputs(torch.float32, "hidden" if soft else None, extra=False, frozen_weight=True)
    ref = run_head_loss("reference", inputs, soft=soft, ce=ce, l1=False)
    eager = run_head_loss("auto", inputs, soft=soft, ce=ce, l1=False)
    compare_head_loss(ref, eager, torch.float32)
    assert inputs[1].grad is None


def test_auto_on_cpu_takes_the_eager_path_and_no_grad_the_reference(monkeypatch):
    calls = []
    package = sys.modules[
        "draftsmith.kernels.head_loss"
    ]  # `draftsmith.kernels.head_loss` the attribute is the function
    monkeypatch.setattr(package, "head_loss_eager", lambda *a: calls.append("eager"))
    monkeypatch.setattr(package, "head_loss_reference", lambda *a: calls.append("reference"))
    x, w = torch.randn(4, D), torch.randn(V, D, requires_grad=True)
    labels = torch.zeros(4, dtype=torch.long)
    with dispatch.use("auto"):
        head_loss(x, w, labels=labels, w_ce=torch.ones(4))
        with torch.no_grad():
            head_loss(x, w, labels=labels, w_ce=torch.ones(4))
    head_loss(x, w, labels=labels, w_ce=torch.ones(4), mode="reference")
    assert calls == ["eager", "reference", "reference"]


def test_a_scaled_upstream_gradient_scales_every_gradient():
    """Backward multiplies the gradients made in forward by the incoming scalar, as autograd would."""
    inputs = head_inputs(torch.float32, "logits", extra=False)
    x, w, _, _, target, labels, (ws, wc, _) = inputs
    grads = []
    for mode in ("reference", "auto"):
        x.grad = w.grad = None
        out = head_loss(x, w, target=target, labels=labels, w_soft=ws, w_ce=wc, chunk_rows=CHUNK_ROWS, mode=mode)
        (out.loss * 3.5).backward()
        grads.append((x.grad.clone(), w.grad.clone()))
    for r, e in zip(*grads, strict=True):
        torch.testing.assert_close(e, r, rtol=1e-4, atol=1e-5 * float(r.abs().max()))
