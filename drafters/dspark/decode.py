"""DSpark drafting at decode time: the backbone's block outputs, then the Markov head slot by slot.

This is vLLM's `DSparkSpeculator._sample_sequential` at temperature 0: base logits for all B slots come from
one parallel backbone pass; slot i adds the Markov bias of the token drafted at slot i-1 (the anchor for
slot 0, all as target ids) and takes the argmax, mapped to a target id. Every slot predicts, so a round
drafts B tokens. Plug `propose` into `drafters.dflash.decode.speculative_generate(..., propose=propose)`.

Shape legend: Q block slots (= block_size), H drafter width, Vout output vocabulary.
"""

from dataclasses import dataclass

import torch

from drafters.dspark.model import DSparkDrafter


@dataclass(frozen=True)
class DraftBlock:
    """One round's drafts (target ids `[Q]`), the logits they were chosen from `[Q, Vout]` (bias included)
    and the confidence head's acceptance probability per slot `[Q]` (None without a confidence head)."""

    tokens: torch.Tensor
    logits: torch.Tensor
    confidence: torch.Tensor | None


def draft_block(drafter: DSparkDrafter, h_QH: torch.Tensor, anchor_token: torch.Tensor | int) -> DraftBlock:
    """Greedy sequential drafting over the backbone outputs `h_QH` (after the final norm) of one block."""
    base = drafter.logits(h_QH)
    prev = torch.as_tensor(anchor_token, device=h_QH.device).reshape(())
    tokens, rows, embs = [], [], []
    for i in range(h_QH.shape[0]):
        emb = drafter.markov_head.embed(prev)
        row = base[i] + drafter.markov_head.project(emb)
        prev = drafter.to_target(row.argmax())
        tokens.append(prev)
        rows.append(row)
        embs.append(emb)
    confidence = None
    if drafter.spec.enable_confidence_head:
        confidence = torch.sigmoid(drafter.confidence_head(h_QH, torch.stack(embs)))
    return DraftBlock(torch.stack(tokens), torch.stack(rows), confidence)


def propose(drafter: DSparkDrafter, h_QH: torch.Tensor, anchor_token: torch.Tensor | int) -> torch.Tensor:
    """The `propose` hook: B drafted target ids `[Q]` for the block whose anchor token is `anchor_token`."""
    return draft_block(drafter, h_QH, anchor_token).tokens
