"""The DSpark loss on a block small enough to check by hand (values worked out in comments)."""

import math

import pytest
import torch

from draftsmith.drafters.dspark.loss import dspark_loss, dspark_rows, target_logp

pytestmark = pytest.mark.unit

L3 = math.log(3.0)


def _case():
    """One row, N = 2 anchors, K = 2 slots, output vocabulary of 2.

    (n0, k0): logits [ln 3, 0] -> p_d = [0.75, 0.25]; label 0; p_t = [0.5, 0.5]; confidence logit 0.
    (n0, k1): logits [ln 3, 0] -> p_d = [0.75, 0.25]; label 1; p_t = [0.1, 0.9]; confidence logit ln 3 (sigma 0.75).
    (n1, k0): not valid; its logits are NaN, so any leak shows up as a NaN total.
    (n1, k1): logits [0, ln 3] -> p_d = [0.25, 0.75]; label 1; p_t = [0.25, 0.75]; confidence logit 0.
    """
    logits = torch.tensor([[[[L3, 0.0], [L3, 0.0]], [[math.nan, math.nan], [0.0, L3]]]])
    target_p = torch.tensor([[[[0.5, 0.5], [0.1, 0.9]], [[0.5, 0.5], [0.25, 0.75]]]])
    conf = torch.tensor([[[0.0, L3], [0.0, 0.0]]])
    labels = torch.tensor([[[0, 1], [0, 1]]])
    valid = torch.tensor([[[True, True], [False, True]]])
    weights = torch.exp(-torch.arange(2) / 4.0)  # [1, exp(-1/4) = 0.778801]
    return logits, conf, target_p.log(), labels, valid, weights


def test_hand_checked_terms_total_and_per_slot():
    logits, conf, tlogp, labels, valid, weights = _case()
    out = dspark_loss(logits, conf, tlogp, labels, valid, weights)
    # Per counted row (CE = -ln p_d[label]; L1 = sum |p_d - p_t|; c* = 1 - L1/2; BCE vs sigma(conf)):
    #   (n0,k0): CE = -ln 0.75 = 0.287682, L1 = 0.25 + 0.25 = 0.5, c* = 0.75, BCE(0 -> 0.75) = ln 2 = 0.693147
    #   (n0,k1): CE = -ln 0.25 = 1.386294, L1 = 0.65 + 0.65 = 1.3, c* = 0.35,
    #            BCE = -(0.35 ln 0.75 + 0.65 ln 0.25) = 1.001780
    #   (n1,k1): CE = -ln 0.75 = 0.287682, L1 = 0, c* = 1, BCE = -ln 0.5 = 0.693147
    # Weights 1, w = 0.778801, w; sum = 2.557602.
    #   CE  = (0.287682 + w * 1.386294 + w * 0.287682) / 2.557602 = 0.622214
    #   L1  = (0.5 + w * 1.3 + 0) / 2.557602 = 0.591351
    #   BCE = (0.693147 + w * 1.001780 + w * 0.693147) / 2.557602 = 0.787127
    #   total = 0.1 * 0.622214 + 0.9 * 0.591351 + 1.0 * 0.787127 = 1.381565
    assert float(out.total) == pytest.approx(1.381565, abs=1e-5)
    # Slot 0: one row, 0.1 * 0.287682 + 0.9 * 0.5 + 0.693147 = 1.171915.
    # Slot 1: mean of (0.1 * 1.386294 + 0.9 * 1.3 + 1.001780) and (0.1 * 0.287682 + 0 + 0.693147) = 1.516162.
    assert out.step_loss.tolist() == pytest.approx([1.171915, 1.516162], abs=1e-5)
    assert out.step_count.tolist() == [1, 2]
    # argmax p_d: (n0,k0) 0 == 0 hit; (n0,k1) 0 != 1 miss; (n1,k1) 1 == 1 hit.
    assert out.step_acc.tolist() == pytest.approx([1.0, 0.5])


@pytest.mark.parametrize(
    ("mix", "expected"),
    [((1.0, 0.0, 0.0), 0.622214), ((0.0, 1.0, 0.0), 0.591351), ((0.0, 0.0, 1.0), 0.787127)],
    ids=["ce", "l1", "bce"],
)
def test_each_term_alone(mix, expected):
    logits, conf, tlogp, labels, valid, weights = _case()
    out = dspark_loss(logits, conf, tlogp, labels, valid, weights, mix=mix)
    assert float(out.total) == pytest.approx(expected, abs=1e-5)


def test_bce_target_carries_no_gradient():
    logits, conf, tlogp, labels, valid, weights = _case()
    logits = logits.clone().requires_grad_(True)
    conf = conf.clone().requires_grad_(True)
    dspark_loss(logits, conf, tlogp, labels, valid, weights, mix=(0.0, 0.0, 1.0)).total.backward()
    # c* is detached: the BCE term moves only the confidence head, never the draft distribution.
    assert torch.count_nonzero(logits.grad) == 0
    # d BCE / d conf = w (sigma(conf) - c*) / sum w: (n0,k0) (0.5 - 0.75) / 2.557602 = -0.097748.
    assert float(conf.grad[0, 0, 0]) == pytest.approx(-0.097748, abs=1e-5)
    assert float(conf.grad[0, 1, 0]) == 0.0  # the invalid row


def test_l1_gradient_reaches_the_logits():
    logits, conf, tlogp, labels, valid, weights = _case()
    logits = logits.clone().requires_grad_(True)
    dspark_loss(logits, conf, tlogp, labels, valid, weights, mix=(0.0, 1.0, 0.0)).total.backward()
    # (n1,k1) matches its target exactly, but |x| has subgradient 0 there; (n0,k0) must move.
    assert float(logits.grad[0, 0, 0].abs().sum()) > 0
    assert not torch.isnan(logits.grad[0, 0]).any()


def test_no_valid_rows_gives_zero_not_nan():
    logits, conf, tlogp, labels, valid, weights = _case()
    out = dspark_loss(logits, conf, tlogp, labels, torch.zeros_like(valid), weights)
    assert float(out.total) == 0.0
    assert out.step_count.tolist() == [0, 0]


def test_rows_form_equals_block_form():
    logits, conf, tlogp, labels, valid, weights = _case()
    rows = dspark_rows(logits[valid], conf[valid], tlogp[valid], labels[valid], torch.tensor([0, 1, 1]), weights)
    block = dspark_loss(logits, conf, tlogp, labels, valid, weights)
    assert float(rows.total) == pytest.approx(float(block.total), abs=1e-6)


def test_shape_mismatch_is_named():
    logits, conf, tlogp, labels, valid, weights = _case()
    with pytest.raises(ValueError, match="weights_K"):
        dspark_loss(logits, conf, tlogp, labels, valid, weights[:1])


def test_target_logp_renormalises_over_draft_ids():
    # Target head over V = 3 and Ht = 1: logits = [0, ln 2, ln 5] at hidden 1 -> softmax [1/8, 2/8, 5/8].
    head = torch.tensor([[0.0], [math.log(2.0)], [math.log(5.0)]])
    h = torch.ones(1, 1)
    full = target_logp(head, h).exp()
    assert full[0].tolist() == pytest.approx([1 / 8, 2 / 8, 5 / 8], abs=1e-6)
    # Draft vocabulary {0, 2}: p_t = [1, 5] / 6, the target's mass renormalised over the draft ids.
    pruned = target_logp(head, h, torch.tensor([0, 2])).exp()
    assert pruned[0].tolist() == pytest.approx([1 / 6, 5 / 6], abs=1e-6)
