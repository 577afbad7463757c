"""Token-budget grouping used by capture and training."""

import random

import pytest

from drafters.data import count_stream_batches, length_grouped_batches, stream_batches
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


def test_stream_batches_group_each_window_and_are_counted_ahead():
    from types import SimpleNamespace

    import torch

    rng = random.Random(7)
    lengths = [rng.randint(1, 90) for _ in range(103)]
    samples = [SimpleNamespace(input_ids=torch.zeros(n), n=i) for i, n in enumerate(lengths)]
    batches = list(stream_batches(iter(samples), 256, 20, seed=3))
    assert len(batches) == count_stream_batches(lengths, 256, 20)
    assert sorted(s.n for b in batches for s in b) == list(range(103))
    for b in batches:
        assert len(b) * max(len(s.input_ids) for s in b) <= 256 or len(b) == 1
        assert len({s.n // 20 for s in b}) == 1  # a batch never mixes windows
    # With the whole stream as one window the batches are the offline ones (same seed, same order).
    whole = [[s.n for s in b] for b in stream_batches(iter(samples), 256, 103, seed=3)]
    assert whole == length_grouped_batches(lengths, 256, seed=3)
