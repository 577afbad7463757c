"""Token-budget grouping used by capture and training."""

import random
from typing import Any, cast

import pytest

from draftsmith.core.batching import group_by_length
from draftsmith.drafters.data import count_stream_steps, stream_steps

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


def _plan(lengths, k):
    from draftsmith.drafters.training.plan import plan_epoch

    return plan_epoch(lengths, budget=256, world=1, grad_accum=2, chunk_samples=64, seed=3, epoch=k)


def test_stream_steps_plan_each_window_and_are_counted_ahead():
    from types import SimpleNamespace

    import torch

    rng = random.Random(7)
    lengths = [rng.randint(1, 90) for _ in range(103)]
    samples: list[Any] = [SimpleNamespace(input_ids=torch.zeros(n), n=i) for i, n in enumerate(lengths)]
    steps = list(stream_steps(iter(samples), 20, _plan))
    assert len(steps) == count_stream_steps(lengths, 20, _plan)
    real = [
        cast(Any, s).n
        for _, mbs, groups in steps
        for mb, g in zip(mbs, groups, strict=True)
        if not mb.padding
        for s in g
    ]
    assert sorted(real) == list(range(103))
    for k, mbs, groups in steps:
        assert len(mbs) == 2  # grad_accum micro-batches per step, fillers included
        for g in groups:
            assert len(g) * max(len(s.input_ids) for s in g) <= 256 or len(g) == 1
            assert {cast(Any, s).n // 20 for s in g} == {k}  # a step never mixes windows
    # With the whole stream as one window the steps are the offline epoch's (same seed, same order).
    whole = [[list(mb.indices) for mb in mbs] for _, mbs, _ in stream_steps(iter(samples), 103, _plan)]
    assert whole == [[list(mb.indices) for mb in step] for step in _plan(lengths, 0).for_rank(0)]


def test_prompt_loss_counts_every_token_after_the_first_of_a_counted_sample_only():
    import torch

    from draftsmith.drafters.data import collate
    from draftsmith.transport.sample import HiddenSample

    def sample(mask: list[int]) -> HiddenSample:
        n = len(mask)
        return HiddenSample(
            "s", torch.arange(n), torch.tensor(mask, dtype=torch.bool), torch.zeros(n, 6), torch.zeros(n, 2)
        )

    answered, short = sample([0, 0, 0, 1, 1]), sample([0, 0, 1])
    plain = collate([answered, short], min_loss_tokens=2)
    assert plain["loss_mask"].tolist() == [[False, False, False, True, True], [False] * 5]
    widened = collate([answered, short], min_loss_tokens=2, prompt_loss=True)
    assert widened["loss_mask"].tolist() == [[False, True, True, True, True], [False] * 5], "padding and short: none"
    assert not collate([answered], zero_mask=True, prompt_loss=True)["loss_mask"].any()
