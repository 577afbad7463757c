"""The EAGLE-3 TTT loss on a case small enough to check by hand (values worked out in comments)."""

import math

import pytest
import torch

from draftsmith.drafters.eagle3.loss import position_mask, simulated_acc_len, ttt_loss

pytestmark = pytest.mark.unit


def _identity(rows):
    """The test feeds logits directly as the 'hidden' rows."""
    return rows


def _case():
    # One sequence, S = 4, draft vocabulary of 2. Target distributions at positions p = 0..3:
    target_p = torch.tensor([[[0.9, 0.1], [0.25, 0.75], [1.0, 0.0], [0.1, 0.9]]])
    loss_mask = torch.tensor([[0, 1, 1, 1]])
    # Depth 0 drafts p = [0.75, 0.25] everywhere; depth 1 is uniform.
    depth0 = torch.tensor([math.log(3.0), 0.0]).expand(1, 4, 2)
    depth1 = torch.zeros(1, 4, 2)
    return target_p.log(), loss_mask, [depth0, depth1]


def test_hand_checked_total_and_per_depth():
    target_logp, loss_mask, logits = _case()
    mask = position_mask(loss_mask, torch.ones(1, 4, dtype=torch.bool))
    # position_mask[p] = loss_mask[p + 1]: p = 0, 1, 2 count; p = 3 has no next token.
    assert mask.tolist() == [[True, True, True, False]]
    out = ttt_loss(_identity, logits, target_logp[mask], mask, decay=0.8)
    # Depth 0, t = 0 predicts p = 1: -(0.25 ln 0.75 + 0.75 ln 0.25) = 1.111641
    #          t = 1 predicts p = 2: -ln 0.75 = 0.287682;  t = 2 -> p = 3 masked.   L0 = 0.699662
    # Depth 1, t = 0 predicts p = 2 under a uniform draft: ln 2 = 0.693147;  t = 1 -> p = 3 masked.
    # Total = L0 + 0.8 * L1 = 1.254180
    assert out.step_loss.tolist() == pytest.approx([0.699662, 0.693147], abs=1e-6)
    assert float(out.total) == pytest.approx(1.254180, abs=1e-6)
    assert out.step_count.tolist() == [2, 1]
    # Depth 0 argmax is token 0: wrong at p = 1 (target argmax 1), right at p = 2.
    assert out.step_acc.tolist() == pytest.approx([0.5, 1.0])


def test_positions_whose_target_argmax_is_not_draftable_do_not_count():
    target_logp, loss_mask, logits = _case()
    in_draft = torch.tensor([[True, True, False, True]])
    mask = position_mask(loss_mask, in_draft)
    out = ttt_loss(_identity, logits, target_logp[mask], mask, decay=0.8)
    assert out.step_loss.tolist() == pytest.approx([1.111641, 0.0], abs=1e-6)
    assert out.step_count.tolist() == [1, 0]
    assert float(out.total) == pytest.approx(1.111641, abs=1e-6)


def test_gradient_flows_only_through_counted_positions():
    target_logp, loss_mask, logits = _case()
    logits = [lg.clone().requires_grad_(True) for lg in logits]
    mask = position_mask(loss_mask, torch.ones(1, 4, dtype=torch.bool))
    out = ttt_loss(_identity, logits, target_logp[mask], mask, decay=0.5)
    out.total.backward()
    assert logits[0].grad[0, :2].abs().sum() > 0 and logits[0].grad[0, 2:].abs().sum() == 0
    assert logits[1].grad[0, 0].abs().sum() > 0 and logits[1].grad[0, 1:].abs().sum() == 0
    # d/dlogits of soft CE = softmax - target, scaled by decay**1 / count: depth 1, t = 0 -> 0.5 * ([.5,.5] - [1,0]).
    assert logits[1].grad[0, 0].tolist() == pytest.approx([-0.25, 0.25])


def test_simulated_acc_len_is_one_plus_cumulative_products():
    assert simulated_acc_len(torch.tensor([0.5, 0.5, 1.0])) == pytest.approx(1 + 0.5 + 0.25 + 0.25)
