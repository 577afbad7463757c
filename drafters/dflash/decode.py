"""Greedy speculative decoding with a block drafter (DFlash, DFlash2, DSpark via `propose`) and an HF target, batch 1.

Prefill: the target runs the prompt with a `TapRecorder` and gives the first token. Each round: the drafter's
per-layer context K/V grows by the taps of the positions verified last round (context K/V is pointwise in the
taps, so appending equals recomputing), the block `[last verified token, MASK x (B-1)]` runs at positions
`p..p+B-1` over that context, a proposer turns the block's outputs into g drafts, the target scores
`[anchor, drafts]` in one forward, greedy verification keeps the matching prefix plus one target token, and
the target cache is cropped to the verified length. The output equals the target's greedy output.

Shape legend: S prompt length, Q block slots, H drafter width, F = num_taps * Ht.
"""

import time
from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from drafters.dflash.model import DFlashDrafter
from drafters.dflash.selector import walk
from drafters.eagle3.decode import Decoded, _stop
from drafters.verify import greedy_verify
from engines.hf import TapRecorder

Propose = Callable[[DFlashDrafter, torch.Tensor, torch.Tensor], torch.Tensor]


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
    return drafter.blocks(ids, positions[None], ctx.kv, masks)[0]


@torch.inference_mode()
def speculative_generate(
    target: PreTrainedModel,
    drafter: DFlashDrafter,
    taps: list[int],
    prompt_S: torch.Tensor,
    *,
    max_new: int,
    eos: set[int],
    propose: Propose | None = None,
) -> Decoded:
    """Greedy speculative decoding of one prompt `[S]`; the output equals the target's greedy output.

    `propose(drafter, h_QH, anchor_token) -> drafts [g]` (target ids) picks the drafts from the block outputs;
    the default is `default_propose` (DFlash/DFlash2). g may be any length (DSpark drafts B).
    """
    propose = propose or default_propose
    start_time = time.perf_counter()
    rec = TapRecorder(target, taps)
    with rec:
        out = target(input_ids=prompt_S[None], use_cache=True)
    cache, generated = out.cache, [int(out.logits[0, -1].argmax())]
    ctx = ContextKV(drafter)
    ctx.extend(rec.features_BSF()[0].float())
    rounds = accepted = 0
    while not eos.intersection(generated) and len(generated) < max_new:
        h = draft_block_hidden(drafter, ctx, generated[-1])
        anchor = prompt_S.new_tensor(generated[-1:])
        drafts = propose(drafter, h, anchor[0]).to(prompt_S.dtype).reshape(-1)
        with rec:
            out = target(input_ids=torch.cat([anchor, drafts])[None], cache=cache, use_cache=True)
        n_acc, emitted = greedy_verify(drafts, out.logits[0].argmax(-1))
        if n_acc < drafts.numel():
            cache.crop(-(drafts.numel() - n_acc))
        ctx.extend(rec.features_BSF()[0, : n_acc + 1].float())
        rounds, accepted = rounds + 1, accepted + n_acc
        generated.extend(emitted)
    return Decoded(_stop(generated, eos, max_new), time.perf_counter() - start_time, rounds, accepted)
