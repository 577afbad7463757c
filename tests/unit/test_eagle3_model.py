"""The drafter trains on exactly what it sees at inference, and greedy verification is exact."""

import pytest
import torch

from draftsmith.drafters.verify import greedy_verify
from tests.support.models import check_chain_matches_ttt, eagle3_drafter

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("norm_output", "fc_norm"), [(False, False), (True, True)])
@torch.no_grad()
def test_ttt_depths_equal_the_inference_chain(norm_output, fc_norm):
    """Depth k at position t == chain step k after a context of positions 0..t (teacher-forced tokens)."""
    model = eagle3_drafter(norm_output, fc_norm)
    S, depth = 9, 3
    ids = torch.randint(0, 50, (1, S))
    feats = torch.randn(1, S, 3 * 24)
    check_chain_matches_ttt(model, ids, feats, depth, range(S - depth - 1))


@torch.no_grad()
def test_ttt_position_does_not_see_the_future():
    model = eagle3_drafter(False, False)
    ids = torch.randint(0, 50, (1, 8))
    feats = torch.randn(1, 8, 72)
    a = model.ttt_forward(ids, feats, 2)
    feats2, ids2 = feats.clone(), ids.clone()
    feats2[:, 5:] += 1.0
    ids2[:, 6:] = (ids2[:, 6:] + 1) % 50  # token t+1+k for t <= 3, k <= 1 is untouched
    b = model.ttt_forward(ids2, feats2, 2)
    torch.testing.assert_close(a[0][:, :5], b[0][:, :5])
    torch.testing.assert_close(a[1][:, :4], b[1][:, :4])


def test_greedy_verify_rules():
    target = torch.tensor([5, 6, 7, 8])
    assert greedy_verify(torch.tensor([5, 6, 7]), target) == (3, [5, 6, 7, 8])  # all accepted + bonus
    assert greedy_verify(torch.tensor([5, 9, 7]), target) == (1, [5, 6])  # stop at first miss, correct it
    assert greedy_verify(torch.tensor([1, 6, 7]), target) == (0, [5])  # later matches do not count
