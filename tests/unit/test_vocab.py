"""Draft vocabulary: d2t/t2d agree, keep the most frequent ids, and bad pairs are caught."""

import pytest
import torch

from draftsmith.drafters.vocab import build_draft_vocab, check_vocab, draft_ids, target_to_draft

pytestmark = pytest.mark.unit


def test_keeps_most_frequent_sorted_with_offsets():
    counts = torch.tensor([0, 5, 1, 9, 0, 7, 3, 0])
    d2t, t2d = build_draft_vocab(counts, 4)
    assert draft_ids(d2t).tolist() == [1, 3, 5, 6]
    assert d2t.tolist() == [1, 2, 3, 3]  # target id = draft id + d2t[draft id]
    assert t2d.tolist() == [False, True, False, True, False, True, True, False]
    check_vocab(d2t, t2d)


def test_ties_and_unseen_tokens_go_to_smaller_ids():
    d2t, t2d = build_draft_vocab(torch.tensor([0, 2, 0, 2, 0]), 4)
    assert draft_ids(d2t).tolist() == [0, 1, 2, 3]
    check_vocab(d2t, t2d)


def test_round_trip_target_to_draft():
    counts = torch.randint(0, 50, (1000,), generator=torch.Generator().manual_seed(0))
    d2t, t2d = build_draft_vocab(counts, 128)
    index = target_to_draft(t2d)
    ids = draft_ids(d2t)
    assert torch.equal(index[ids], torch.arange(128))
    assert (index[~t2d] == -1).all()
    # The kept ids really are the top 128 by count.
    assert counts[ids].min() >= counts[~t2d].max()


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        (lambda d2t, t2d: t2d.__setitem__(0, not t2d[0]), "t2d marks"),
        (lambda d2t, t2d: d2t.__setitem__(1, d2t[1] + 1), "t2d does not mark|not strictly increasing"),
        (lambda d2t, t2d: d2t.__setitem__(3, 100), "outside the target vocabulary"),
    ],
)
def test_inconsistent_pairs_are_rejected(breakage, message):
    d2t, t2d = build_draft_vocab(torch.tensor([4, 0, 3, 2, 1, 0, 5, 0]), 4)
    breakage(d2t, t2d)
    with pytest.raises(ValueError, match=message):
        check_vocab(d2t, t2d)


def test_draft_vocab_larger_than_target_is_an_error():
    with pytest.raises(ValueError, match="exceeds"):
        build_draft_vocab(torch.ones(8), 9)
