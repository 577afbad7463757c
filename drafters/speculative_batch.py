"""Speculative decoding of a small batch of prompts: one target forward per round verifies every row.

Rows accept different numbers of drafts, so their target caches would go ragged. Instead of cropping
(which `DynamicCache` can only do for the whole batch), every row's cache grows by the same `G + 1` slots
per round and the slots a row did not keep are masked out of attention from then on: holes in a 2-D
attention mask. Positions (RoPE) are logical, counted over a row's kept tokens, so a row sees exactly the
keys and positions it would see alone; only the matmul shapes differ (fp32 sums may differ in the last
bits). Prompts are right-padded for the same reason: a padded query always has earlier keys to attend to,
so no attention row is fully masked.

Each row keeps its own proposer (drafters are small; their batch-1 calls are cheap next to the target),
its own generator and its own `Decoded` statistics, recorded exactly as `speculative_decode` does.

Shape legend: B rows, S prompt length (padded Sp), G the longest draft this round, V target vocabulary,
L cache slots so far, F = N*Ht fused taps.
"""

import time
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from draftsmith.drafters.speculative import GREEDY, Decoded, Draft, Proposer, Truncate, _stop, draw, is_greedy
from draftsmith.drafters.verify import Rule, Sampling, greedy_verify, verify, warp
from draftsmith.engines.hf import TapRecorder


class BatchTarget:
    """The target's side: a shared cache, a `[B, L]` key mask with holes, and each row's next position."""

    def __init__(self, target: PreTrainedModel, taps: list[int] | None) -> None:
        self.target, self.rec = target, TapRecorder(target, taps) if taps else None
        self.cache = None
        self.mask: torch.Tensor | None = None  # [B, L] 1 = a key later queries may attend to
        self.next_pos: torch.Tensor | None = None  # [B] tokens kept so far per row

    def forward(self, ids_BQ: torch.Tensor, real_BQ: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append `[B, Q]` tokens (`real_BQ` marks real ones, a prefix of each row); logits `[B, Q, V]` (fp32)
        and taps `[B, Q, F]` (None without taps). Call `keep` before the next forward."""
        new = real_BQ.long()
        self.mask = new if self.mask is None else torch.cat([self.mask, new], dim=1)
        start = torch.zeros(ids_BQ.shape[0], dtype=torch.long) if self.next_pos is None else self.next_pos
        inputs = {"input_ids": ids_BQ, "attention_mask": self.mask, "use_cache": True}
        inputs["position_ids"] = start[:, None] + torch.arange(ids_BQ.shape[1])[None]
        if self.cache is not None:
            inputs["cache"] = self.cache
        if self.rec is None:
            out, feats = self.target(**inputs), None
        else:
            with self.rec:
                out = self.target(**inputs)
            feats = self.rec.features_BSF().float()
        self.cache, self.width = out.cache, ids_BQ.shape[1]
        return out.logits.float(), feats

    def keep(self, kept: Sequence[int]) -> None:
        """Row b keeps the first `kept[b]` slots of the last forward; the rest become holes."""
        n = torch.tensor(list(kept), dtype=torch.long)
        assert self.mask is not None, "keep follows a forward"
        self.mask[:, -self.width :] = (torch.arange(self.width)[None] < n[:, None]).long()
        self.next_pos = n if self.next_pos is None else self.next_pos + n


def _pad(rows: list[torch.Tensor], fill: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad 1-D rows to `[B, W]` (W the longest, at least 1); and the `[B, W]` mask of real entries."""
    width = max(1, max(r.numel() for r in rows))
    ids = torch.full((len(rows), width), fill, dtype=torch.long)
    real = torch.zeros((len(rows), width), dtype=torch.bool)
    for b, r in enumerate(rows):
        ids[b, : r.numel()], real[b, : r.numel()] = r, True
    return ids, real


def _row(tokens: list[int]) -> torch.Tensor:
    return torch.tensor(tokens, dtype=torch.long)


def _done(tokens: list[int], eos: set[int], max_new: int) -> bool:
    return bool(eos.intersection(tokens)) or len(tokens) >= max_new


def _prefill(bt: BatchTarget, prompts: Sequence[torch.Tensor], sampling: Sampling, gens: Sequence[torch.Generator]):
    """Run the right-padded prompts; `(taps [B, Sp, F] or None, lengths, each row's first token in a list)`."""
    logits, feats = bt.forward(*_pad(list(prompts)))
    lengths = [p.numel() for p in prompts]
    bt.keep(lengths)
    return feats, lengths, [[draw(logits[b, n - 1], sampling, gens[b])[0]] for b, n in enumerate(lengths)]


def _verify(draft: Draft, logits_QV: torch.Tensor, sampling: Sampling, rule: Rule, gen: torch.Generator):
    """`(accepted, emitted)` for one row: the same rules as `speculative_decode`."""
    if is_greedy(sampling):
        return greedy_verify(draft.tokens, logits_QV.argmax(-1))
    verdict = verify(rule, draft.tokens, draft.q, warp(logits_QV, sampling), gen)
    return verdict.accepted, verdict.tokens


@torch.inference_mode()
def speculative_decode_batch(
    target: PreTrainedModel,
    taps: list[int],
    proposers: Sequence[Proposer],
    prompts: Sequence[torch.Tensor],
    *,
    max_new: int,
    eos: set[int],
    sampling: Sampling = GREEDY,
    rule: Rule = "token",
    generators: Sequence[torch.Generator],
    truncate: Truncate | None = None,
) -> list[Decoded]:
    """Speculative decoding of prompts `[S_b]` together; row b drafts with `proposers[b]` and samples with
    `generators[b]`. Every row's `seconds` is the batch's wall time: rows share each forward."""
    start_time, gens = time.perf_counter(), generators
    bt = BatchTarget(target, taps)
    feats, lengths, generated = _prefill(bt, prompts, sampling, gens)
    for b, proposer in enumerate(proposers):
        proposer.prefill(feats[b, : lengths[b]], prompts[b], generated[b][0])
    results = [Decoded(tokens=[], seconds=0.0) for _ in prompts]
    while active := [b for b, t in enumerate(generated) if not _done(t, eos, max_new)]:
        drafts: dict[int, Draft] = {}
        for b in active:
            draft = proposers[b].propose(generated[b][-1], sampling, gens[b])
            drafts[b] = draft.head(truncate(draft)) if truncate is not None else draft
        rows = [
            _row([generated[b][-1], *drafts[b].tokens.tolist()] if b in drafts else []) for b in range(len(prompts))
        ]
        logits, feats = bt.forward(*_pad(rows))
        assert feats is not None, "drafters read the taps"
        kept = [0] * len(prompts)
        for b in active:
            n_acc, emitted = _verify(drafts[b], logits[b, : rows[b].numel()], sampling, rule, gens[b])
            kept[b] = n_acc + 1
            proposers[b].accept(feats[b, : n_acc + 1], emitted)
            results[b].record(drafts[b], n_acc)
            generated[b].extend(emitted)
        bt.keep(kept)
    seconds = time.perf_counter() - start_time
    for b, r in enumerate(results):
        r.tokens, r.seconds = _stop(generated[b], eos, max_new), seconds
    return results


@torch.inference_mode()
def plain_decode_batch(
    target: PreTrainedModel,
    prompts: Sequence[torch.Tensor],
    *,
    max_new: int,
    eos: set[int],
    sampling: Sampling = GREEDY,
    generators: Sequence[torch.Generator],
) -> list[Decoded]:
    """The batched baseline: one target forward per token for every unfinished row."""
    start_time, gens = time.perf_counter(), generators
    bt = BatchTarget(target, None)
    _, _, generated = _prefill(bt, prompts, sampling, gens)
    while active := [b for b, t in enumerate(generated) if not _done(t, eos, max_new)]:
        rows = [_row(generated[b][-1:] if b in active else []) for b in range(len(prompts))]
        logits, _ = bt.forward(*_pad(rows))
        for b in active:
            generated[b].append(draw(logits[b, 0], sampling, gens[b])[0])
        bt.keep([int(b in active) for b in range(len(prompts))])
    seconds = time.perf_counter() - start_time
    return [Decoded(_stop(t, eos, max_new), seconds) for t in generated]
