"""Sampled speculative decoding end to end (`draftsmith.drafters.speculative`) with each family's proposer: the
distribution of the first generated tokens equals the target's own sampling distribution (chi-square),
for token and block verification; DSpark's dynamic truncation keeps greedy decoding exact.

The target is a 12-token random Llama, so random drafters' samples are often accepted: both accepts and
rejections (residual resampling) shape what is emitted.
"""

import pytest
import torch

from draftsmith.drafters.dflash.decode import speculative_generate as block_generate
from draftsmith.drafters.dspark import decode as dspark_decode
from draftsmith.drafters.eagle3.decode import greedy_generate
from draftsmith.drafters.eagle3.decode import speculative_generate as chain_generate
from draftsmith.drafters.speculative import plain_decode
from draftsmith.drafters.verify import Sampling, warp
from tests.support.models import TAPS3, dflash_drafter, small_llama
from tests.support.models import eagle3_mla_drafter as eagle_drafter
from tests.support.models import eagle3_mla_spec as eagle_spec
from tests.support.models import random_dspark as dspark_drafter
from tests.support.stats import chi_square

pytestmark = pytest.mark.unit
V, N, L = 12, 400, 2
SAMPLING = Sampling(temperature=1.0, top_p=0.95)


@pytest.fixture(scope="module")
def target():
    return small_llama(V, 24, seed=0)


def _law(target, prompt: torch.Tensor) -> torch.Tensor:
    """The target's exact law of its first two sampled tokens `[V, V]` under `SAMPLING`."""
    with torch.no_grad():
        p1 = warp(target(input_ids=prompt[None]).logits[0, -1:].float(), SAMPLING)[0]
        ext = torch.cat([prompt.expand(V, -1), torch.arange(V)[:, None]], dim=1)
        p2 = warp(target(input_ids=ext).logits[:, -1].float(), SAMPLING)
    return p1[:, None] * p2


def _drafters():
    eagle = eagle_drafter(eagle_spec(target_hidden_size=24, vocab_size=V, draft_vocab_size=V), seed=3)
    with torch.no_grad():
        eagle.embed_tokens.weight.copy_(torch.randn(V, 32, generator=torch.Generator().manual_seed(5)))
    dflash, dspark = dflash_drafter(V, 24, seed=3), dspark_drafter(V, 24, seed=3)
    return {
        "eagle3": lambda t, p, **kw: chain_generate(t, eagle, [1, 2, 3], p, g=3, **kw),
        "dflash2": lambda t, p, **kw: block_generate(t, dflash, [1, 2, 3], p, **kw),
        "dspark": lambda t, p, **kw: block_generate(t, dspark, TAPS3, p, pick=dspark_decode.pick, **kw),
    }


@pytest.mark.parametrize(("kind", "rule"), [("eagle3", "token"), ("dflash2", "block"), ("dspark", "token")])
def test_sampled_speculative_decoding_follows_the_target_law(target, kind, rule):
    prompt = torch.tensor([3, 1, 4, 1, 5])
    generate = _drafters()[kind]
    counts = torch.zeros(V, V)
    g = torch.Generator().manual_seed(11)
    accepted = rounds = 0
    with torch.no_grad():
        for _ in range(N):
            out = generate(target, prompt, max_new=L, eos=set(), sampling=SAMPLING, rule=rule, generator=g)
            counts[out.tokens[0], out.tokens[1]] += 1
            accepted, rounds = accepted + out.accepted, rounds + out.rounds
    stat, dof, p = chi_square(counts, _law(target, prompt))
    assert p > 1e-3, (kind, rule, stat, dof, p)
    assert accepted > 0  # drafts were accepted, so the rule (not only the target) produced tokens


def test_the_chi_square_rejects_a_sampler_that_ignores_top_p(target):
    """Power check: plain temperature-1 sampling is not the top_p 0.95 law."""
    prompt = torch.tensor([3, 1, 4, 1, 5])
    counts = torch.zeros(V, V)
    g = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for _ in range(N):
            out = plain_decode(target, prompt, max_new=L, eos=set(), sampling=Sampling(1.0, 1.0), generator=g)
            counts[out.tokens[0], out.tokens[1]] += 1
    assert chi_square(counts, _law(target, prompt))[2] < 1e-3


def test_dspark_dynamic_truncation_keeps_greedy_exact_and_drafts_less(target):
    drafter = dspark_drafter(V, 24, seed=3)
    prompt = torch.tensor([2, 7, 1, 8])
    base = greedy_generate(target, prompt, max_new=20, eos=set())
    with torch.no_grad():
        full = block_generate(target, drafter, TAPS3, prompt, max_new=20, eos=set(), pick=dspark_decode.pick)
        cut = block_generate(
            target, drafter, TAPS3, prompt, max_new=20, eos=set(), pick=dspark_decode.pick, truncate=lambda d: 1
        )
    assert full.tokens == base.tokens == cut.tokens
    assert cut.drafted == cut.rounds < full.drafted  # one draft per round survived the cut
    assert len(full.confidence) == full.rounds and all(len(c) == 4 for c, _ in full.confidence)
