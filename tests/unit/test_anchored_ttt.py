"""Anchored TTT equals dense TTT when every position is an anchor (and is cheaper per depth otherwise)."""

import pytest
import torch

from draftsmith.drafters.anchors import strided_anchors
from draftsmith.drafters.eagle3.anchored import anchored_hidden, anchored_loss
from draftsmith.drafters.eagle3.loss import position_mask, ttt_loss
from tests.support.models import TTT_B as B
from tests.support.models import TTT_DEPTH as DEPTH
from tests.support.models import TTT_S as S
from tests.support.models import eagle3_drafter, ttt_batch

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("norm_output", "fc_norm"), [(False, False), (True, True)])
def test_every_position_an_anchor_equals_dense_ttt(norm_output, fc_norm):
    model = eagle3_drafter(norm_output, fc_norm)
    ids, feats, loss_mask, in_draft, last, head = ttt_batch()
    mask = position_mask(loss_mask, in_draft)
    dense_hidden = model.ttt_hidden(ids, feats, DEPTH)
    target = (last[mask] @ head.T).log_softmax(-1)
    dense = ttt_loss(model.logits, dense_hidden, target, mask, 0.8)

    anchors = torch.arange(S).expand(B, S).contiguous()
    keep = torch.ones(B, S, dtype=torch.bool)
    hidden = anchored_hidden(model, ids, feats, anchors, keep, DEPTH)
    for d in range(DEPTH):
        torch.testing.assert_close(hidden[d], dense_hidden[d], rtol=1e-5, atol=1e-5)
    got = anchored_loss(model, hidden, anchors, keep, last, head, mask, 0.8)
    assert got.step_count.tolist() == dense.step_count.tolist()
    torch.testing.assert_close(got.step_loss, dense.step_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.total, dense.total, rtol=1e-5, atol=1e-6)
    got.total.backward()  # gradients flow through the anchored path
    assert model.fc.weight.grad is not None and model.fc.weight.grad.abs().sum() > 0


def test_sampled_anchors_compute_dense_ttt_at_those_anchors_only():
    model = eagle3_drafter(True, True)
    ids, feats, loss_mask, in_draft, last, head = ttt_batch(1)
    anchors, keep = strided_anchors(loss_mask, 4, DEPTH, max_gap=DEPTH, generator=torch.Generator().manual_seed(2))
    keep[1, -1] = False  # a dropped slot stays finite and out of the loss
    with torch.no_grad():
        dense_hidden = model.ttt_hidden(ids, feats, DEPTH)
        hidden = anchored_hidden(model, ids, feats, anchors, keep, DEPTH)
    rows = torch.arange(B)[:, None].expand_as(anchors)
    for d in range(DEPTH):
        assert torch.isfinite(hidden[d]).all()
        torch.testing.assert_close(hidden[d][keep], dense_hidden[d][rows[keep], anchors[keep]], rtol=1e-5, atol=1e-5)
