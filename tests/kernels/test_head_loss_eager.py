"""The eager fused head loss (`auto` on CPU: gradients made in forward) against the autograd reference.

Same odd shapes as `test_head_loss` (T = 63 rows in chunks of 20, V = 300, D = 72), every target form and the
DSpark extra term; the eager path must give the reference's loss terms, accuracies and gradients.
"""

import sys

import pytest
import torch

from draftsmith.kernels import dispatch
from draftsmith.kernels.head_loss import head_loss
from tests.kernels.test_head_loss import CHUNK_ROWS, D, V, _compare, _inputs, _run

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
    inputs = _inputs(dtype, form, extra=extra)
    ref = _run("reference", inputs, soft=True, ce=True, l1=True)
    eager = _run("auto", inputs, soft=True, ce=True, l1=True)
    _compare(ref, eager, dtype)


@pytest.mark.parametrize(("soft", "ce"), [(True, False), (False, True)])
def test_single_terms_and_a_frozen_head(poisoned_empty, soft, ce):
    """EAGLE-3's soft CE alone and DFlash's CE alone, the head frozen (no weight gradient is made)."""
    inputs = _inputs(torch.float32, "hidden" if soft else None, extra=False, frozen_weight=True)
    ref = _run("reference", inputs, soft=soft, ce=ce, l1=False)
    eager = _run("auto", inputs, soft=soft, ce=ce, l1=False)
    _compare(ref, eager, torch.float32)
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
    inputs = _inputs(torch.float32, "logits", extra=False)
    x, w, _, _, target, labels, (ws, wc, _) = inputs
    grads = []
    for mode in ("reference", "auto"):
        x.grad = w.grad = None
        out = head_loss(x, w, target=target, labels=labels, w_soft=ws, w_ce=wc, chunk_rows=CHUNK_ROWS, mode=mode)
        (out.loss * 3.5).backward()
        grads.append((x.grad.clone(), w.grad.clone()))
    for r, e in zip(*grads, strict=True):
        torch.testing.assert_close(e, r, rtol=1e-4, atol=1e-5 * float(r.abs().max()))
