"""Token-budget grouping used by capture and training."""

import random

import pytest

from drafters.data import length_grouped_batches
from draftsmith.batching import group_by_length

pytestmark = pytest.mark.unit


def test_every_sample_once_within_budget_longest_first():
    rng = random.Random(0)
    lengths = [rng.randint(1, 300) for _ in range(200)]
    batches = group_by_length(lengths, 1024)
    assert sorted(i for b in batches for i in b) == list(range(200))
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 1024
        assert lengths[b[0]] == max(lengths[i] for i in b)
    firsts = [lengths[b[0]] for b in batches]
    assert firsts == sorted(firsts, reverse=True)


def test_oversized_sample_gets_its_own_batch():
    assert group_by_length([5000, 10, 10], 1024) == [[0], [1, 2]]


def test_training_order_is_a_seeded_permutation_of_the_same_batches():
    lengths = [random.Random(1).randint(1, 300) for _ in range(100)]
    a = length_grouped_batches(lengths, 1024, seed=3)
    assert a == length_grouped_batches(lengths, 1024, seed=3)
    assert sorted(map(tuple, a)) == sorted(map(tuple, group_by_length(lengths, 1024)))
