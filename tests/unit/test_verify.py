"""The verification rules are lossless: what they emit has exactly the target's law.

A toy autoregressive pair on V=5 tokens: target p(x_t | x_{t-2}, x_{t-1}) and draft q(. | same context) are
random tables. Speculative decoding repeats rounds (draft g tokens from q, verify against p) until L tokens
exist; the law of those L-token sequences must equal the target's exact product law, whatever mix of
1..g+1-token rounds produced them. Pearson's chi-square compares the two.

The p-value is the chi-square survival function, Q(dof/2, stat/2), the regularised upper incomplete gamma
(`torch.special.gammaincc`), so scipy is not needed. Lossless rules must give p > 1e-3. Every run is seeded,
so each test's verdict is fixed; the alpha only says how unlucky a correct rule would have to be to fail.
A deliberately broken rule must give p < 1e-6: that is the proof that the test has power.
"""

import itertools
import math
from bisect import bisect_right
from typing import Any, cast

import pytest
import torch

from draftsmith.drafters.verify import Sampling, Verdict, block_verify, greedy_verify, token_verify, verify, warp
from tests.support.stats import chi_square

pytestmark = pytest.mark.unit

V, BOS = 5, 5  # tokens 0..4; BOS pads the context of the first two positions
ALPHA = 1e-3
# (sampling, logit scale of the random tables): the warped case uses flatter tables so that the nucleus keeps
# about 3 of the 5 tokens, leaving impossible tokens without making any position deterministic.
T1 = (Sampling(temperature=1.0), 1.5)
WARPED = (Sampling(temperature=0.8, top_p=0.9), 1.0)
CASES = pytest.mark.parametrize("case", [T1, WARPED], ids=["T1", "T0.8-top_p0.9"])


def _ctx(prev2: int, prev1: int) -> int:
    return prev2 * (V + 1) + prev1


class Toy:
    """Target and draft conditionals `[(V+1)^2 contexts, V]` (fp64), both warped by the same `Sampling`."""

    def __init__(self, seed: int, s: Sampling, scale: float = 1.5):
        gen = torch.Generator().manual_seed(seed)
        self.p_CV = warp(torch.randn((V + 1) ** 2, V, generator=gen) * scale, s).double()
        self.q_CV = warp(torch.randn((V + 1) ** 2, V, generator=gen) * scale, s).double()
        self.q_cdf = self.q_CV.cumsum(-1).tolist()

    def law(self, L: int) -> torch.Tensor:
        """Exact target probability of every L-token sequence `[V^L]`, first token most significant."""
        out = []
        for seq in itertools.product(range(V), repeat=L):
            hist, prob = [BOS, BOS], 1.0
            for x in seq:
                prob *= float(self.p_CV[_ctx(*hist[-2:]), x])
                hist.append(x)
            out.append(prob)
        return torch.tensor(out, dtype=torch.float64)

    def round_inputs(self, hist: list[int], g: int, uniforms) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Draft g tokens from q after `hist`; return draft_ids [g], q_gV [g, V], p_g1V [g+1, V]."""
        drafts, ctxs = [], [_ctx(*hist[-2:])]
        for _ in range(g):
            cdf = self.q_cdf[ctxs[-1]]
            drafts.append(bisect_right(cdf, next(uniforms) * cdf[-1]))
            ctxs.append(_ctx(*(hist + drafts)[-2:]))
        c = torch.tensor(ctxs)
        return torch.tensor(drafts), self.q_CV[c[:g]], self.p_CV[c]


def _generate(toy: Toy, rule, *, g: int, L: int, n_seq: int, seed: int) -> torch.Tensor:
    """Counts `[V^L]` of the first L tokens of n_seq independent speculative generations."""
    gen = torch.Generator().manual_seed(seed)
    uniforms = iter(torch.rand(n_seq * L * g, generator=torch.Generator().manual_seed(seed + 1)).double().tolist())
    counts = torch.zeros(V**L, dtype=torch.float64)
    for _ in range(n_seq):
        hist = [BOS, BOS]
        while len(hist) < L + 2:
            hist += rule(*toy.round_inputs(hist, g, uniforms), gen).tokens
        counts[sum(x * V ** (L - 1 - k) for k, x in enumerate(hist[2 : L + 2]))] += 1
    return counts


def _report(name: str, counts: torch.Tensor, law: torch.Tensor, L: int) -> list[tuple[float, int, float]]:
    """Chi-square of the first token, the first two, and all L tokens; printed for the record."""
    shape = [V] * L
    c, p = counts.view(shape), law.view(shape)
    out = [chi_square(c.sum(dim=tuple(range(1, L))), p.sum(dim=tuple(range(1, L)))),
           chi_square(c.sum(dim=tuple(range(2, L))), p.sum(dim=tuple(range(2, L)))),
           chi_square(counts, law)]  # fmt: skip
    print(
        f"{name}: "
        + "; ".join(f"{k} tok chi2={s:.1f} dof={d} p={pv:.3g}" for k, (s, d, pv) in zip((1, 2, L), out, strict=True))
    )
    return out


def test_chi_square_p_value_is_the_chi2_survival_function():
    # Closed forms: dof 2 -> exp(-x/2); dof 1 at 3.841459 -> 0.05.
    probs = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    stat, dof, p = chi_square(torch.tensor([30.0, 20.0, 50.0]), probs)
    assert dof == 2 and stat == pytest.approx(100 / 20 + 100 / 30) and p == pytest.approx(math.exp(-stat / 2))
    assert torch.special.gammaincc(torch.tensor(0.5), torch.tensor(3.841459 / 2)) == pytest.approx(0.05, abs=1e-6)
    assert chi_square(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]))[2] == 0.0  # impossible cell observed


def test_warp_applies_temperature_then_nucleus_and_greedy_is_one_hot():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4]]))
    assert torch.equal(warp(logits, Sampling()), torch.tensor([[1.0, 0, 0, 0], [0, 0, 0, 1.0]]))
    torch.testing.assert_close(warp(logits, Sampling(temperature=0.5)), torch.softmax(logits / 0.5, -1))
    nucleus = warp(logits, Sampling(temperature=1.0, top_p=0.75))
    torch.testing.assert_close(nucleus[0], torch.tensor([0.625, 0.375, 0.0, 0.0]))  # 0.5 + 0.3 reaches 0.75
    torch.testing.assert_close(nucleus[1], torch.tensor([0.0, 2 / 9, 3 / 9, 4 / 9]))  # 0.4 + 0.3 < 0.75
    assert torch.equal(warp(logits, Sampling(temperature=1.0, top_p=0.4))[0], torch.tensor([1.0, 0, 0, 0]))
    for bad in ({"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"temperature": math.nan}):
        with pytest.raises(ValueError, match="Sampling"):
            Sampling(**bad)


def test_greedy_verify_keeps_its_contract():
    assert greedy_verify(torch.tensor([3, 1, 4]), torch.tensor([3, 1, 2, 7])) == (2, [3, 1, 2])
    assert greedy_verify(torch.tensor([3, 1]), torch.tensor([3, 1, 9])) == (2, [3, 1, 9])
    assert greedy_verify(torch.tensor([0]), torch.tensor([5, 6])) == (0, [5])
    assert verify("greedy", torch.tensor([3, 1]), None, torch.eye(10)[[3, 2, 0]], None) == Verdict(1, [3, 2])


@pytest.mark.parametrize("rule", ["greedy", "token", "block"])
def test_temperature_zero_emits_exactly_the_target_argmax_path(rule):
    toy, L, g = Toy(seed=3, s=Sampling()), 12, 3
    path = [BOS, BOS]
    while len(path) < L + 2:
        path.append(int(toy.p_CV[_ctx(*path[-2:])].argmax()))
    for seed in range(3):  # the generator must not matter
        gen, hist, rejected = torch.Generator().manual_seed(seed), [BOS, BOS], 0
        uniforms = itertools.repeat(0.5)  # one-hot q: any uniform drafts its argmax
        while len(hist) < L + 2:
            draft_ids, q_gV, p_g1V = toy.round_inputs(hist, g, uniforms)
            v = verify(rule, draft_ids, q_gV, p_g1V, gen)
            rejected += v.accepted < g
            hist += v.tokens
        assert hist[: L + 2] == path
        assert rejected > 0  # the draft is wrong somewhere, so corrections were exercised


@CASES
@pytest.mark.parametrize("rule", [token_verify, block_verify], ids=["token", "block"])
def test_emitted_sequences_follow_the_target_law(rule, case):
    # g=2 drafts and L=3 tokens: a fully accepted round (3 tokens with the bonus) and every shorter mix
    # of rounds lands in the same 3-token law.
    (sampling, scale), L = case, 3
    toy = Toy(seed=11, s=sampling, scale=scale)
    law = toy.law(L)
    counts = _generate(toy, rule, g=2, L=L, n_seq=5000, seed=5)
    for stat, dof, p in _report(f"{rule.__name__} {sampling}", counts, law, L):
        assert p > ALPHA and dof >= 2, f"chi2={stat:.1f} dof={dof} p={p:.2e}"
    if sampling.top_p < 1:  # nucleus cut leaves impossible sequences; they must never appear
        assert (law == 0).sum() > 0 and counts[law == 0].sum() == 0


def _no_residual(draft_ids, q_gV, p_g1V, generator) -> Verdict:
    """Broken: accepts with min(1, p/q) but on rejection resamples from p instead of norm(max(0, p - q))."""
    v = token_verify(draft_ids, q_gV, p_g1V, generator)
    if v.accepted == draft_ids.numel():
        return v
    return Verdict(v.accepted, v.tokens[:-1] + [int(torch.multinomial(p_g1V[v.accepted], 1, generator=generator))])


def test_chi_square_rejects_a_rule_without_the_residual():
    (sampling, scale), L = T1, 3
    toy = Toy(seed=11, s=sampling, scale=scale)
    stats = _report("broken (no residual)", _generate(toy, _no_residual, g=2, L=L, n_seq=2000, seed=5), toy.law(L), L)
    assert stats[-1][2] < 1e-6 and stats[0][2] < ALPHA


def _accepted(rule, drafts_NG: torch.Tensor, q_gV, p_g1V, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.tensor([rule(d, q_gV, p_g1V, gen).accepted for d in drafts_NG], dtype=torch.float64)


def test_block_beats_token_on_the_papers_example():
    # Sun et al. 2024, Sec. 2: context-free target [1/3, 2/3], draft [2/3, 1/3], gamma = 2. Expected accepted
    # drafts: token verification 10/9, block verification 11/9 (the optimum with the full joint is 12/9).
    p, q, g, n = torch.tensor([1 / 3, 2 / 3]).double(), torch.tensor([2 / 3, 1 / 3]).double(), 2, 4000
    drafts = torch.multinomial(q, n * g, replacement=True, generator=torch.Generator().manual_seed(0)).view(n, g)
    tok = _accepted(token_verify, drafts, q.expand(g, 2), p.expand(g + 1, 2), seed=1)
    blk = _accepted(block_verify, drafts, q.expand(g, 2), p.expand(g + 1, 2), seed=1)
    print(f"paper example: token {tok.mean():.4f} (10/9=1.1111), block {blk.mean():.4f} (11/9=1.2222), n={n}")
    for got, want in ((tok, 10 / 9), (blk, 11 / 9)):
        assert abs(got.mean() - want) < 4 * got.std() / n**0.5
    assert blk.mean() - tok.mean() > 4 * (blk - tok).std() / n**0.5


def _token_expected_accepted(q_gV, p_g1V_rows) -> float:
    """Exact E[accepted] of token verification for a context-free pair: sum_k prod_i sum_x min(p_i, q_i)."""
    alpha = [float(torch.minimum(p, q).sum()) for p, q in zip(p_g1V_rows[: len(q_gV)], q_gV, strict=True)]
    return sum(math.prod(alpha[:k]) for k in range(1, len(alpha) + 1))


@CASES
def test_block_accepts_at_least_as_many_as_token(case):
    # Same random p and q (g=4 positions, a context-free chain so token verification has a closed form),
    # same drafts for both rules; the paired difference must not be negative beyond Monte-Carlo noise.
    (sampling, scale), gen, g, n = case, torch.Generator().manual_seed(7), 4, 3000
    p_g1V = warp(torch.randn(g + 1, V, generator=gen) * scale, sampling).double()
    q_gV = warp(torch.randn(g, V, generator=gen) * scale, sampling).double()
    drafts = torch.stack([torch.multinomial(q_gV[i], n, replacement=True, generator=gen) for i in range(g)], 1)
    tok, blk = _accepted(token_verify, drafts, q_gV, p_g1V, 2), _accepted(block_verify, drafts, q_gV, p_g1V, 2)
    exact, se = _token_expected_accepted(q_gV, p_g1V), (blk - tok).std().item() / n**0.5
    print(f"{sampling}: token {tok.mean():.4f} (exact {exact:.4f}), block {blk.mean():.4f}, diff se {se:.4f}")
    assert abs(tok.mean() - exact) < 4 * tok.std() / n**0.5  # the Monte-Carlo harness measures what it should
    assert se > 0 and blk.mean() - tok.mean() > -3 * se  # se > 0: the rules disagreed on some rounds


def test_verify_dispatches_and_names_bad_inputs():
    p_g1V, q_gV, d = torch.eye(4)[[1, 2, 3]], torch.eye(4)[[1, 2]], torch.tensor([1, 2])
    for rule in ("greedy", "token", "block"):
        assert verify(rule, d, q_gV, p_g1V, torch.Generator().manual_seed(0)) == Verdict(2, [1, 2, 3])
    with pytest.raises(ValueError, match="unknown rule 'beam'"):
        verify(cast(Any, "beam"), d, q_gV, p_g1V, None)  # not a Rule: the run-time check
    with pytest.raises(ValueError, match="needs q_gV"):
        verify("token", d, None, p_g1V, None)
    with pytest.raises(ValueError, match=r"p_g1V \[g\+1, V\]"):
        token_verify(d, q_gV, p_g1V[:2], torch.Generator())
    with pytest.raises(ValueError, match="probability 0"):
        block_verify(torch.tensor([0, 2]), q_gV, p_g1V, torch.Generator())
