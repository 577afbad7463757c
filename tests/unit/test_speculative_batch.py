"""Batched speculative decoding: each row of a batch decodes exactly as it would alone.

Rows have different prompt lengths and accept different numbers of drafts per round, so the shared target
cache carries holes (rejected slots and right padding) in its attention mask. Greedy rows must equal plain
greedy decoding and batch-1 speculative decoding round for round; sampled rows with the same per-row seeds
must draw the same tokens as batch 1 (only fp32 summation order differs between the two).
"""

import pytest
import torch

from draftsmith.drafters.dflash.decode import BlockProposer
from draftsmith.drafters.speculative import plain_decode, speculative_decode
from draftsmith.drafters.speculative_batch import plain_decode_batch, speculative_decode_batch
from draftsmith.drafters.verify import Sampling
from tests.support.models import DFLASH_TAPS as TAPS
from tests.support.models import DFLASH_VARIANTS as SMALL
from tests.support.models import dflash_drafter, small_llama

pytestmark = pytest.mark.unit

LENGTHS = (3, 9, 6, 1)


@pytest.fixture(scope="module")
def target():
    return small_llama(12, 24, seed=0)


def _prompts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 12, (n,), generator=g) for n in LENGTHS]


def _gens(seed: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + b) for b in range(len(LENGTHS))]


def test_plain_batch_equals_plain_per_row(target):
    # eos 7 ends some rows early; the others keep decoding around their finished neighbours.
    got = plain_decode_batch(target, _prompts(), max_new=15, eos={7}, generators=_gens(0))
    for row, prompt in zip(got, _prompts(), strict=True):
        assert row.tokens == plain_decode(target, prompt, max_new=15, eos={7}).tokens
    assert len({len(r.tokens) for r in got}) > 1  # rows really finished at different times


@pytest.mark.parametrize("case", ["dflash2", "dspark-like"])
def test_greedy_batch_equals_batch_one_round_for_round(target, case):
    drafter = dflash_drafter(12, 24, seed=3, **SMALL[case])
    if case == "dspark-like":
        drafter.d2t.copy_(torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]))
        drafter.t2d.zero_()
        drafter.t2d[torch.arange(8) + drafter.d2t] = True
    prompts = _prompts()
    got = speculative_decode_batch(
        target, TAPS, [BlockProposer(drafter) for _ in prompts], prompts, max_new=20, eos=set(), generators=_gens(0)
    )
    for row, prompt in zip(got, prompts, strict=True):
        alone = speculative_decode(target, TAPS, BlockProposer(drafter), prompt, max_new=20, eos=set())
        assert row.tokens == alone.tokens == plain_decode(target, prompt, max_new=20, eos=set()).tokens
        assert (row.rounds, row.accepted, row.accept_hist) == (alone.rounds, alone.accepted, alone.accept_hist)
    # Rows accepted different counts in the same round: the holes in the cache mask were exercised.
    assert len({tuple(r.accept_hist) for r in got}) > 1


def test_sampled_batch_draws_what_batch_one_draws(target):
    drafter = dflash_drafter(12, 24, seed=3, **SMALL["dflash2"])
    prompts, sampling = _prompts(), Sampling(temperature=1.0, top_p=0.95)
    got = speculative_decode_batch(
        target, TAPS, [BlockProposer(drafter) for _ in prompts], prompts, max_new=20, eos=set(), sampling=sampling,
        rule="block", generators=_gens(11),
    )  # fmt: skip
    for row, prompt, gen in zip(got, prompts, _gens(11), strict=True):
        alone = speculative_decode(
            target, TAPS, BlockProposer(drafter), prompt, max_new=20, eos=set(), sampling=sampling, rule="block",
            generator=gen,
        )  # fmt: skip
        assert (row.tokens, row.accepted) == (alone.tokens, alone.accepted)
    assert sum(r.accepted for r in got) > 0
