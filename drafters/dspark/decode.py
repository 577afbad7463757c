"""DSpark drafting at decode time: the backbone's block outputs, then the Markov head slot by slot.

This is vLLM's `DSparkSpeculator._sample_sequential` at temperature 0: base logits for all B slots come from
one parallel backbone pass; slot i adds the Markov bias of the token drafted at slot i-1 (the anchor for
slot 0, all as target ids) and takes the argmax, mapped to a target id. Every slot predicts, so a round
drafts B tokens. Plug `propose` into `draftsmith.drafters.dflash.decode.speculative_generate(..., propose=propose)`.

Shape legend: Q block slots (= block_size), H drafter width, Vout output vocabulary.
"""

from dataclasses import dataclass

import torch

from draftsmith.drafters.dspark.model import DSparkDrafter
from draftsmith.drafters.speculative import GREEDY, Draft, draw
from draftsmith.drafters.verify import Sampling


@dataclass(frozen=True)
class DraftBlock:
    """One round's drafts (target ids `[Q]`), the logits they were chosen from `[Q, Vout]` (bias included),
    the confidence head's logits and acceptance probabilities per slot `[Q]` (None without a confidence head)
    and, when sampled, the distributions the drafts were drawn from over the target vocabulary `[Q, V]`."""

    tokens: torch.Tensor
    logits: torch.Tensor
    confidence: torch.Tensor | None
    confidence_logits: torch.Tensor | None = None
    q: torch.Tensor | None = None


def draft_block(
    drafter: DSparkDrafter,
    h_QH: torch.Tensor,
    anchor_token: torch.Tensor | int,
    sampling: Sampling = GREEDY,
    generator: torch.Generator | None = None,
) -> DraftBlock:
    """Sequential drafting over the backbone outputs `h_QH` (after the final norm) of one block: slot i adds the
    Markov bias of the token drawn at slot i-1, then takes the argmax (greedy) or samples `warp(row)`."""
    base = drafter.logits(h_QH)
    prev = torch.as_tensor(anchor_token, device=h_QH.device).reshape(())
    tokens, rows, embs, qs = [], [], [], []
    for i in range(h_QH.shape[0]):
        emb = drafter.markov_head.embed(prev)
        row = base[i] + drafter.markov_head.project(emb)
        index, q = draw(row, sampling, generator)
        prev = drafter.to_target(torch.tensor(index, device=row.device))
        tokens.append(prev)
        rows.append(row)
        embs.append(emb)
        if q is not None:
            qs.append(_over_target(drafter, q))
    conf_logits = confidence = None
    if drafter.spec.enable_confidence_head:
        conf_logits = drafter.confidence_head(h_QH, torch.stack(embs))
        confidence = torch.sigmoid(conf_logits)
    q = torch.stack(qs) if qs else None
    return DraftBlock(torch.stack(tokens), torch.stack(rows), confidence, conf_logits, q)


def _over_target(drafter: DSparkDrafter, q_Vout: torch.Tensor) -> torch.Tensor:
    if drafter.spec.draft_vocab_size is None:
        return q_Vout
    q = q_Vout.new_zeros(drafter.spec.vocab_size)
    q[drafter.to_target(torch.arange(q_Vout.numel(), device=q_Vout.device))] = q_Vout
    return q


def propose(drafter: DSparkDrafter, h_QH: torch.Tensor, anchor_token: torch.Tensor | int) -> torch.Tensor:
    """The `propose` hook: B drafted target ids `[Q]` for the block whose anchor token is `anchor_token`."""
    return draft_block(drafter, h_QH, anchor_token).tokens


def pick(drafter: DSparkDrafter, h_QH: torch.Tensor, anchor: torch.Tensor, sampling: Sampling, generator) -> Draft:
    """The `Pick` for `drafters.dflash.decode.BlockProposer`: drafts, their distributions and confidence logits."""
    block = draft_block(drafter, h_QH, anchor, sampling, generator)
    return Draft(block.tokens, block.q, block.confidence_logits)
