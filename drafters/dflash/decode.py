"""Greedy speculative decoding with a block drafter (DFlash, DFlash2, DSpark via `propose`) and an HF target, batch 1.

Prefill: the target runs the prompt with a `TapRecorder` and gives the first token. Each round: the drafter's
per-layer context K/V grows by the taps of the positions verified last round (context K/V is pointwise in the
taps, so appending equals recomputing), the block `[last verified token, MASK x (B-1)]` runs at positions
`p..p+B-1` over that context, a proposer turns the block's outputs into g drafts, the target scores
`[anchor, drafts]` in one forward, greedy verification keeps the matching prefix plus one target token, and
the target cache is cropped to the verified length. The output equals the target's greedy output.

Shape legend: S prompt length, Q block slots, H drafter width, F = num_taps * Ht.
"""

from collections.abc import Callable
from typing import Any

import torch
from transformers import PreTrainedModel

from draftsmith.drafters.dflash.model import DFlashDrafter
from draftsmith.drafters.dflash.selector import walk
from draftsmith.drafters.speculative import GREEDY, Decoded, Draft, is_greedy, speculative_decode
from draftsmith.drafters.verify import Rule, Sampling, warp

Propose = Callable[[Any, torch.Tensor, torch.Tensor], torch.Tensor]  # the drafter is the proposer's own, as in Pick


def default_propose(drafter: DFlashDrafter, h_QH: torch.Tensor, anchor_token: torch.Tensor) -> torch.Tensor:
    """Drafts `[g]` (target ids) from the predicting slots: argmax per slot, or the DFlash2 selector walk."""
    spec = drafter.spec
    h = h_QH[spec.first_slot :]
    logits = drafter.logits(h)
    if not spec.selector_rank:
        return drafter.to_target(logits.argmax(-1))
    unary, cand = logits.topk(spec.selector_top_k, dim=-1)  # [L, K] each, as vLLM's get_top_k_tokens
    scores = drafter.candidate_selector.edge_scores(cand[None], unary[None], h[None], anchor_token.reshape(1))
    return walk(scores, cand[None])[0]


class ContextKV:
    """The drafter's per-layer context K/V for positions `0..length-1`; verified positions are only appended."""

    def __init__(self, drafter: DFlashDrafter) -> None:
        self.drafter = drafter
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.length = 0

    def extend(self, features_SF: torch.Tensor) -> None:
        positions = torch.arange(self.length, self.length + features_SF.shape[0], device=features_SF.device)
        new = self.drafter.context_kv(self.drafter.context(features_SF[None]), positions)
        if self.kv is None:
            self.kv = new
        else:
            pairs = zip(self.kv, new, strict=True)
            self.kv = [(torch.cat([k, nk], 2), torch.cat([v, nv], 2)) for (k, v), (nk, nv) in pairs]
        self.length += features_SF.shape[0]


def draft_block_hidden(drafter: DFlashDrafter, ctx: ContextKV, anchor_token: int) -> torch.Tensor:
    """`[Q, H]`: the block anchored at position `ctx.length` (the anchor token's position), after the final norm."""
    spec = drafter.spec
    device = drafter.fc.weight.device
    ids = torch.full((1, spec.block_size), spec.mask_token_id, dtype=torch.long, device=device)
    ids[0, 0] = anchor_token
    positions = torch.arange(ctx.length, ctx.length + spec.block_size, device=device)
    masks = drafter.decode_masks(torch.arange(ctx.length, device=device), positions)
    assert ctx.kv is not None, "the context was extended with the prompt first"
    return drafter.blocks(ids, positions[None], ctx.kv, masks)[0]


# The drafter is the proposer's own, of the pick's family (DSpark's pick takes a DSparkDrafter), hence Any.
Pick = Callable[[Any, torch.Tensor, torch.Tensor, Sampling, torch.Generator | None], Draft]


def default_pick(
    drafter: DFlashDrafter,
    h_QH: torch.Tensor,
    anchor: torch.Tensor,
    sampling: Sampling,
    generator: torch.Generator | None,
) -> Draft:
    """DFlash/DFlash2 drafts: `default_propose` when greedy; sampled, each predicting slot draws from its own
    distribution (the slots are conditionally independent given the context; the DFlash2 selector walk is a
    greedy search and is not used when sampling)."""
    if is_greedy(sampling):
        return Draft(default_propose(drafter, h_QH, anchor))
    logits = drafter.logits(h_QH[drafter.spec.first_slot :])
    probs = warp(logits.float(), sampling)  # [L, Vout]
    picks = torch.multinomial(probs, 1, generator=generator)[:, 0]
    q = probs
    if drafter.spec.draft_vocab_size is not None:  # lay the pruned distributions over the target vocabulary
        q = probs.new_zeros(probs.shape[0], drafter.spec.vocab_size)
        q[:, drafter.to_target(torch.arange(probs.shape[1], device=probs.device))] = probs
    return Draft(drafter.to_target(picks), q)


def greedy_pick(propose: Propose) -> Pick:
    """A tokens-only `propose` hook as a greedy `Pick`."""

    def pick(drafter, h_QH, anchor, sampling, generator) -> Draft:
        if not is_greedy(sampling):
            raise ValueError("this proposer drafts greedily only; use temperature 0")
        return Draft(propose(drafter, h_QH, anchor))

    return pick


class BlockProposer:
    """A block drafter's side of `drafters.speculative`: one parallel block per round over a growing context."""

    def __init__(self, drafter: DFlashDrafter, pick: Pick = default_pick) -> None:
        self.drafter, self.pick, self.ctx = drafter, pick, ContextKV(drafter)

    def prefill(self, features_SF: torch.Tensor, prompt_S: torch.Tensor, first: int) -> None:
        self.ctx.extend(features_SF)

    def propose(self, last: int, sampling: Sampling, generator: torch.Generator) -> Draft:
        h = draft_block_hidden(self.drafter, self.ctx, last)
        draft = self.pick(self.drafter, h, torch.tensor(last, device=h.device), sampling, generator)
        return Draft(draft.tokens.reshape(-1).long(), draft.q, draft.confidence)

    def accept(self, features_nF: torch.Tensor, emitted: list[int]) -> None:
        self.ctx.extend(features_nF)


def speculative_generate(
    target: PreTrainedModel,
    drafter: DFlashDrafter,
    taps: list[int],
    prompt_S: torch.Tensor,
    *,
    max_new: int,
    eos: set[int],
    propose: Propose | None = None,
    pick: Pick | None = None,
    sampling: Sampling = GREEDY,
    rule: Rule = "token",
    generator: torch.Generator | None = None,
    truncate=None,
) -> Decoded:
    """Speculative decoding of one prompt `[S]`; greedy output equals the target's greedy output.

    `pick` chooses the drafts from the block outputs (default `default_pick`); a tokens-only `propose(drafter,
    h_QH, anchor_token) -> drafts [g]` hook is accepted for greedy decoding. g may be any length (DSpark drafts B).
    """
    chosen = pick or (greedy_pick(propose) if propose is not None else default_pick)
    return speculative_decode(
        target, taps, BlockProposer(drafter, chosen), prompt_S, max_new=max_new, eos=eos, sampling=sampling,
        rule=rule, generator=generator, truncate=truncate,
    )  # fmt: skip
