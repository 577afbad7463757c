"""Block-drafter speculative decoding is exactly the target's greedy decoding, and drafts what it trained on."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from draftsmith.drafters.dflash.decode import speculative_generate
from draftsmith.drafters.eagle3.decode import greedy_generate
from draftsmith.engines.hf import TapRecorder
from tests.support.models import DFLASH_TAPS as TAPS
from tests.support.models import DFLASH_VARIANTS, dflash_drafter, small_llama

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def small_vocab_target():
    """A 12-token Llama, so a random drafter's guesses are sometimes accepted and rollback is exercised."""
    return small_llama(12, 24, seed=0)


@pytest.mark.parametrize("case", list(DFLASH_VARIANTS))
def test_decode_equals_target_greedy_with_rollback(small_vocab_target, case):
    drafter = dflash_drafter(12, 24, seed=3, **DFLASH_VARIANTS[case])
    if case == "dspark-like":
        drafter.d2t.copy_(torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]))  # target ids 0 1 3 4 6 7 9 10
        drafter.t2d.zero_()
        drafter.t2d[torch.arange(8) + drafter.d2t] = True
    g = torch.Generator().manual_seed(0)
    rounds = accepted = 0
    for _ in range(3):
        prompt = torch.randint(0, 12, (6,), generator=g)
        base = greedy_generate(small_vocab_target, prompt, max_new=20, eos=set())
        got = speculative_generate(small_vocab_target, drafter, TAPS, prompt, max_new=20, eos=set())
        assert got.tokens == base.tokens
        rounds, accepted = rounds + got.rounds, accepted + got.accepted
    per_round = 4 if case == "dspark-like" else 3
    assert 0 < accepted < per_round * rounds, (accepted, rounds)


@pytest.fixture(scope="module")
def tiny_target():
    from draftsmith.core.target_setup import ensure_tiny_target

    return AutoModelForCausalLM.from_pretrained(ensure_tiny_target(), dtype=torch.float32).eval()


@torch.no_grad()
def test_decode_drafts_the_trained_block_and_equals_greedy(tiny_target):
    """With an oracle proposer that gets exactly m drafts right, every round's block outputs equal
    `train_hidden` at the same anchor over the whole sequence's taps, and the output equals greedy."""
    V, Ht = tiny_target.config.vocab_size, tiny_target.config.hidden_size
    drafter = dflash_drafter(V, Ht, seed=4, conv_kernel_size=2, conv_group_size=8)
    prompt = torch.randint(0, 1000, (9,), generator=torch.Generator().manual_seed(1))
    base = greedy_generate(tiny_target, prompt, max_new=40, eos=set())
    full = torch.cat([prompt, torch.tensor(base.tokens)])
    seen: list[tuple[int, torch.Tensor]] = []
    state = {"pos": prompt.numel(), "m": 0}

    def oracle(d, h_QH, anchor):
        p, m = state["pos"], state["m"] % 4  # m = 0..3 right drafts, then wrong ones
        assert int(anchor) == int(full[p])
        seen.append((p, h_QH.clone()))
        truth = full[p + 1 : p + 4]
        drafts = truth.clone()
        drafts[m:] = (truth[m:] + 1) % V
        state["pos"], state["m"] = p + min(m, len(truth)) + 1, state["m"] + 1
        return drafts

    got = speculative_generate(tiny_target, drafter, TAPS, prompt, max_new=30, eos=set(), propose=oracle)
    assert got.tokens == base.tokens[:30]
    assert got.accepted > 0 and got.rounds < 30
    with TapRecorder(tiny_target, TAPS) as rec:
        tiny_target(input_ids=full[None])
    anchors = torch.tensor([[p for p, _ in seen]])
    packed = drafter.train_hidden(full[None], rec.features_BSF().float(), anchors, torch.ones_like(anchors).bool())
    for i, (_, h) in enumerate(seen):
        assert torch.allclose(packed[0, i], h, atol=1e-4), i
