"""Speculative decoding with an EAGLE-3 chain drafter and an HF target, batch 1, KV caches on both.

Each round: the drafter extends its context with the target features of the tokens verified last
round, drafts a chain of `g` tokens, the target scores `[last token, drafts]` in one forward, greedy
verification keeps the longest matching prefix plus one target token, and both caches roll back to
the verified length. The baseline is plain greedy decoding with the same target and cache.

Shape legend: S sequence, F = N*Ht fused feature width, h heads, T cached keys, d head width.
"""

import time
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from drafters.eagle3.model import Eagle3Drafter
from drafters.verify import greedy_verify
from engines.hf import TapRecorder


@dataclass
class Decoded:
    """One generation: the new tokens, verification rounds and accepted drafts (0 for the baseline)."""

    tokens: list[int]
    seconds: float
    rounds: int = 0
    accepted: int = 0


class DraftCache:
    """The drafter's keys `[1, h, T, dqk]` and values `[1, h, T, dv]` (per head, for GQA and MLA alike);
    context entries persist, chain entries are cropped."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v

    def crop(self, length: int) -> None:
        if self.k is not None:
            self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]


def _draft_forward(
    drafter: Eagle3Drafter, tokens_S: torch.Tensor, hidden_SH: torch.Tensor, start: int, cache: DraftCache
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run new positions `start..start+S-1` against the cache; returns logits `[S, Vd]` and next hidden."""
    layer = drafter.midlayer
    x = layer.attn_input(drafter.embed_tokens(tokens_S)[None], hidden_SH[None])
    S = tokens_S.numel()
    q, k, v = layer.self_attn.qkv(x, torch.arange(start, start + S))
    past = cache.length
    keys, values = cache.append(k, v)
    scores = q @ keys.transpose(-1, -2) * layer.self_attn.scale
    allowed = torch.arange(keys.shape[2])[None, :] <= past + torch.arange(S)[:, None]
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    logits, next_hidden = drafter.head(layer.finish(probs @ values, hidden_SH[None]))
    return logits[0], next_hidden[0]


def _draft_chain(
    drafter: Eagle3Drafter,
    feats_SF: torch.Tensor,
    tokens_S: torch.Tensor,
    start: int,
    cache: DraftCache,
    g: int,
) -> torch.Tensor:
    """Extend the context with verified positions, then draft `g` tokens (target ids)."""
    logits, hidden = _draft_forward(drafter, tokens_S, drafter.fuse(feats_SF[None])[0], start, cache)
    context = cache.length
    drafts = [drafter.draft_to_target(logits[-1].argmax())]
    hidden, pos = hidden[-1:], start + tokens_S.numel()
    for _ in range(g - 1):
        logits, hidden = _draft_forward(drafter, drafts[-1].view(1), hidden, pos, cache)
        drafts.append(drafter.draft_to_target(logits[-1].argmax()))
        pos += 1
    cache.crop(context)
    return torch.stack(drafts)


def _stop(tokens: list[int], eos: set[int], max_new: int) -> list[int]:
    """Cut at the first end-of-turn token (kept) or at `max_new` tokens."""
    for i, t in enumerate(tokens[:max_new]):
        if t in eos:
            return tokens[: i + 1]
    return tokens[:max_new]


@torch.inference_mode()
def speculative_generate(
    target: PreTrainedModel,
    drafter: Eagle3Drafter,
    taps: list[int],
    prompt_S: torch.Tensor,
    *,
    g: int,
    max_new: int,
    eos: set[int],
) -> Decoded:
    """Greedy speculative decoding of one prompt `[S]`; the output equals the target's greedy output."""
    start_time = time.perf_counter()
    rec = TapRecorder(target, taps)
    with rec:
        out = target(input_ids=prompt_S[None], use_cache=True)
    cache, generated = out.cache, [int(out.logits[0, -1].argmax())]
    dcache = DraftCache()
    feats, tokens, start = rec.features_BSF()[0], torch.cat([prompt_S[1:], prompt_S.new_tensor(generated)]), 0
    rounds = accepted = 0
    while not eos.intersection(generated) and len(generated) < max_new:
        drafts = _draft_chain(drafter, feats.float(), tokens, start, dcache, g)
        verify_in = torch.cat([prompt_S.new_tensor(generated[-1:]), drafts])
        with rec:
            out = target(input_ids=verify_in[None], cache=cache, use_cache=True)
        n_acc, emitted = greedy_verify(drafts, out.logits[0].argmax(-1))
        if n_acc < g:
            cache.crop(-(g - n_acc))
        rounds, accepted = rounds + 1, accepted + n_acc
        start += tokens.numel()
        feats, tokens = rec.features_BSF()[0, : n_acc + 1], prompt_S.new_tensor(emitted)
        generated.extend(emitted)
    return Decoded(_stop(generated, eos, max_new), time.perf_counter() - start_time, rounds, accepted)


@torch.inference_mode()
def greedy_generate(target: PreTrainedModel, prompt_S: torch.Tensor, *, max_new: int, eos: set[int]) -> Decoded:
    """Plain greedy decoding with a KV cache: the baseline."""
    start_time = time.perf_counter()
    out = target(input_ids=prompt_S[None], use_cache=True)
    cache, generated = out.cache, [int(out.logits[0, -1].argmax())]
    while generated[-1] not in eos and len(generated) < max_new:
        out = target(input_ids=prompt_S.new_tensor(generated[-1:])[None], cache=cache, use_cache=True)
        generated.append(int(out.logits[0, -1].argmax()))
    return Decoded(_stop(generated, eos, max_new), time.perf_counter() - start_time)
