"""Anchor sampling: candidates, fixed slots with keep masks, inclusion probability, gaps, the dense case."""

import pytest
import torch

from draftsmith.drafters.anchors import candidates, strided_anchors, uniform_anchors

pytestmark = pytest.mark.unit


def test_candidates_start_on_two_supervised_tokens_and_leave_room_for_the_chain():
    mask = torch.tensor([0, 1, 1, 1, 0, 1, 1, 0, 1, 1, 1, 1])
    assert candidates(mask, depth=1).tolist() == [1, 2, 5, 8, 9, 10]
    assert candidates(mask, depth=3).tolist() == [1, 2, 5, 8, 9]  # a <= S - depth = 9


def test_every_candidate_is_an_anchor_when_there_are_enough_slots():
    mask = torch.tensor([[0, 1, 1, 1, 1, 0, 1, 1], [0, 0, 0, 0, 0, 0, 0, 0]])
    anchors, keep = strided_anchors(mask, num=10, depth=1, max_gap=0, generator=torch.Generator().manual_seed(0))
    assert anchors[0][keep[0]].tolist() == candidates(mask[0], 1).tolist()
    assert not keep[1].any() and anchors.shape == keep.shape == (2, 10)


def test_strided_anchors_pick_each_candidate_with_probability_num_over_count_and_bound_gaps():
    mask = torch.ones(1, 203)
    cand = candidates(mask[0], depth=3)
    count, num, max_gap = len(cand), 20, 10
    hits = torch.zeros(count)
    g = torch.Generator().manual_seed(1)
    for _ in range(3000):
        anchors, keep = strided_anchors(mask, num, depth=3, max_gap=max_gap, generator=g)
        picked = anchors[0][keep[0]]
        assert len(picked) == num and torch.equal(picked, picked.sort().values)
        pos = torch.searchsorted(cand, picked)
        assert (torch.diff(pos) <= max_gap + 1).all()
        hits[pos] += 1
    rate = hits / 3000
    assert (rate - num / count).abs().max() < 0.03  # ~0.1 each, binomial noise ~0.006


def test_max_gap_zero_makes_anchors_contiguous():
    mask = torch.ones(1, 100)
    anchors, keep = strided_anchors(mask, 8, depth=2, max_gap=0, generator=torch.Generator().manual_seed(3))
    picked = anchors[0][keep[0]]
    diffs = torch.diff(picked)
    assert ((diffs == 1).sum() >= 6) and len(picked) == 8  # contiguous, one break at most if it wrapped


def test_uniform_anchors_are_distinct_sorted_candidates():
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 0, 1, 1], [0, 1, 1, 0, 0, 0, 0, 0, 0, 0]])
    g = torch.Generator().manual_seed(4)
    anchors, keep = uniform_anchors(mask, num=4, generator=g)
    for b in range(2):
        picked = anchors[b][keep[b]]
        assert len(set(picked.tolist())) == len(picked) == min(4, len(candidates(mask[b], 2)))
        assert torch.equal(picked, picked.sort().values)
        assert set(picked.tolist()) <= set(candidates(mask[b], 2).tolist())
    with pytest.raises(ValueError, match="num >= 1"):
        uniform_anchors(mask, 0, g)
