"""Verification rules: which drafted tokens the target keeps, and the one token it adds.

Every rule emits `accepted + 1` tokens a round: the accepted draft prefix, then one target token (a
correction where the draft was refused, a bonus after a fully accepted block). Every rule is lossless:
the text it emits has exactly the target's law (greedy: exactly the target's argmax path).
`tests/unit/test_verify.py` checks this with chi-square tests on a toy autoregressive model.

Shapes, for g drafts over a vocabulary of V:
  draft_ids [g]   drafted token ids;
  q_gV [g, V]     row i: the law draft i was sampled from (after `warp`);
  p_g1V [g+1, V]  row i: the target's law after the last verified token and i drafts (after the same
                  `warp`); row g gives the bonus token.
Randomness comes only from the `generator` passed in (on the tensors' device).
"""

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

Rule = Literal["greedy", "token", "block"]


@dataclass(frozen=True)
class Sampling:
    """The target's sampling settings. temperature 0 is greedy; top_p 1 turns nucleus filtering off."""

    temperature: float = 0.0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"Sampling.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"Sampling.top_p must be in (0, 1], got {self.top_p}")


@dataclass(frozen=True)
class Verdict:
    accepted: int  # drafts kept this round
    tokens: list[int]  # the kept drafts, then one target token: accepted + 1 ids


def warp(logits_nV: Tensor, s: Sampling) -> Tensor:
    """Probabilities `[n, V]` (fp32) from logits `[n, V]`: temperature, then nucleus (top_p).

    Losslessness holds against the *warped* target, so the draft's logits go through this same function:
    q must be the law the drafts were really sampled from, p the law the user asked for.
    """
    logits = logits_nV.float()
    if s.temperature == 0:  # the T -> 0 limit: all mass on the argmax, so every rule becomes exact matching
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    probs = torch.softmax(logits / s.temperature, dim=-1)
    if s.top_p < 1:
        head, order = probs.sort(dim=-1, descending=True, stable=True)
        # Smallest head with mass >= top_p: a token stays while the mass above it is < top_p (the top one always).
        head = head.masked_fill(head.cumsum(-1) - head >= s.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, head)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def greedy_verify(draft_ids: Tensor, target_argmax: Tensor) -> tuple[int, list[int]]:
    """Accepted count and the tokens this round emits.

    Greedy: draft i is kept iff it is the target's argmax given the kept prefix; the target's argmax at the
    first mismatch (or after the last draft) is emitted, so the output is the target's greedy output.

    Args:
        draft_ids: `[g]` drafted token ids (target vocabulary).
        target_argmax: `[g + 1]` target argmax after the last verified token and after each draft.
    """
    matches = (draft_ids == target_argmax[: draft_ids.numel()]).int()
    accepted = int(matches.cumprod(0).sum())
    return accepted, draft_ids[:accepted].tolist() + [int(target_argmax[accepted])]


def token_verify(draft_ids: Tensor, q_gV: Tensor, p_g1V: Tensor, generator: torch.Generator) -> Verdict:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023), one token at a time."""
    g, p_x, q_x = _draft_probs(draft_ids, q_gV, p_g1V)
    u = torch.rand(g + 1, generator=generator, device=p_g1V.device, dtype=torch.float64).tolist()
    # Keep draft i w.p. min(1, p/q) (u*q < p needs no division): tokens the draft over-proposes are thinned
    # down to p, so kept drafts never carry more mass than the target gives them.
    n = next((i for i in range(g) if not u[i] * q_x[i] < p_x[i]), g)
    # Thinning removed exactly max(0, p - q) of mass; drawing the correction from it restores p.
    last = p_g1V[g] if n == g else (p_g1V[n] - q_gV[n]).clamp_min(0)
    return Verdict(n, draft_ids[:n].tolist() + [_sample(last, p_g1V[n], u[g])])


def block_verify(draft_ids: Tensor, q_gV: Tensor, p_g1V: Tensor, generator: torch.Generator) -> Verdict:
    """Block verification (Sun et al. 2024, arXiv 2403.10444, Algorithm 2): the block is judged jointly."""
    g, p_x, q_x = _draft_probs(draft_ids, q_gV, p_g1V)
    eta = torch.rand(g + 1, generator=generator, device=p_g1V.device, dtype=torch.float64).tolist()
    # a_i (the paper's p_i): the fraction of prefix X^i that the target covers. Unlike token verification,
    # min(1, .) is taken of the running product, so a later under-proposed token (p/q > 1) repays an earlier
    # over-proposed one instead of the deficit being final.
    a = [1.0]
    for i in range(g):
        a.append(min(1.0, a[-1] * p_x[i] / q_x[i]))
    a_g1 = torch.tensor(a, dtype=p_g1V.dtype, device=p_g1V.device)
    # R_i: target mass after X^i that the draft under-covers once X^i is weighted by a_i, i.e. what a
    # correction at i can still emit. h_i keeps X^i with the odds R_i : (1 - a_i), the residual that can pay
    # for stopping here against the prefix mass that was not accepted (0/0 only when a_i = 1: keep).
    resid = (a_g1[:g, None] * p_g1V[:g] - q_gV).clamp_min(0).sum(-1).tolist()
    h = [resid[i] / (resid[i] + 1 - a[i]) if resid[i] + 1 - a[i] > 0 else 1.0 for i in range(1, g)] + [a[g]]
    # Coins are drawn for every prefix and the *longest* passing one wins: the decision runs from the whole
    # block down, which is what lets a repaid deficit keep the block.
    tau = max([i + 1 for i in range(g) if eta[i] < h[i]], default=0)
    last = p_g1V[g] if tau == g else (a_g1[tau] * p_g1V[tau] - q_gV[tau]).clamp_min(0)
    return Verdict(tau, draft_ids[:tau].tolist() + [_sample(last, p_g1V[tau], eta[g])])


def verify(
    rule: Rule, draft_ids: Tensor, q_gV: Tensor | None, p_g1V: Tensor, generator: torch.Generator | None
) -> Verdict:
    """Apply `rule` to one round. Greedy reads only the argmax of `p_g1V`, so `q_gV` and `generator` may be None."""
    if rule == "greedy":
        return Verdict(*greedy_verify(draft_ids, p_g1V.argmax(-1)))
    if rule not in ("token", "block"):
        raise ValueError(f"verify: unknown rule {rule!r}; expected 'greedy', 'token' or 'block'")
    if q_gV is None or generator is None:
        raise ValueError(f"verify: rule {rule!r} needs q_gV (the draft's law) and a torch.Generator")
    return (token_verify if rule == "token" else block_verify)(draft_ids, q_gV, p_g1V, generator)


def _draft_probs(draft_ids: Tensor, q_gV: Tensor, p_g1V: Tensor) -> tuple[int, list[float], list[float]]:
    """g, then p and q of each draft token (`[g]` each); checks shapes and that q could have drawn the drafts."""
    g = draft_ids.numel()
    if draft_ids.dim() != 1 or q_gV.dim() != 2 or q_gV.shape[0] != g or p_g1V.shape != (g + 1, q_gV.shape[1]):
        raise ValueError(
            f"verify: want draft_ids [g], q_gV [g, V], p_g1V [g+1, V]; got {tuple(draft_ids.shape)}, "
            f"{tuple(q_gV.shape)}, {tuple(p_g1V.shape)}"
        )
    rows = torch.arange(g, device=p_g1V.device)
    p_x, q_x = p_g1V[rows, draft_ids].tolist(), q_gV[rows, draft_ids].tolist()
    if min(q_x, default=1.0) <= 0:
        raise ValueError("verify: q_gV gives a draft token probability 0; q must be the law the drafts came from")
    return g, p_x, q_x


def _sample(weights_V: Tensor, fallback_V: Tensor, u: float) -> int:
    """Inverse-CDF draw from unnormalised `weights_V [V]` with the uniform `u`: zero-weight ids are never drawn.

    `fallback_V` is used only when rounding left a residual with no mass.
    """
    w = weights_V if float(weights_V.sum()) > 0 else fallback_V
    cdf = w.cumsum(0)
    idx = int(torch.searchsorted(cdf, u * float(cdf[-1]), right=True))
    return idx if idx < cdf.numel() else int(w.nonzero().max())  # u * total rounded up to the total
