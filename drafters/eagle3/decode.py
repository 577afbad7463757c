"""Speculative decoding with an EAGLE-3 chain drafter and an HF target, batch 1, KV caches on both.

`EagleProposer` is EAGLE-3's side of `draftsmith.drafters.speculative`: each round the drafter extends its context with
the target features of the tokens verified last round and drafts a chain of `g` tokens (greedy, or sampled
with their distributions kept for the sampling rules); the shared loop verifies and rolls both caches back.

Shape legend: S sequence, F = N*Ht fused feature width, h heads, T cached keys, d head width.
"""

import torch
from transformers import PreTrainedModel

from draftsmith.drafters.eagle3.model import Eagle3Drafter
from draftsmith.drafters.speculative import GREEDY, Decoded, Draft, draw, plain_decode, speculative_decode
from draftsmith.drafters.verify import Rule, Sampling


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
        if self.k is not None and self.v is not None:
            self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]


def draft_forward(
    drafter: Eagle3Drafter, tokens_S: torch.Tensor, hidden_SH: torch.Tensor, start: int, cache: DraftCache
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run new positions `start..start+S-1` against the cache; returns logits `[S, Vd]` and next hidden."""
    layer = drafter.midlayer
    x = layer.attn_input(drafter.embed_tokens(tokens_S)[None], hidden_SH[None])
    S = tokens_S.numel()
    q, k, v = layer.self_attn.qkv(x, torch.arange(start, start + S, device=x.device))
    past = cache.length
    keys, values = cache.append(k, v)
    scores = q @ keys.transpose(-1, -2) * layer.self_attn.scale
    dev = scores.device
    allowed = torch.arange(keys.shape[2], device=dev)[None, :] <= past + torch.arange(S, device=dev)[:, None]
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
    sampling: Sampling = GREEDY,
    generator: torch.Generator | None = None,
) -> Draft:
    """Extend the context with verified positions, then draft `g` tokens (target ids), greedy or sampled.

    Sampled drafts come with their distributions over the target vocabulary `[g, V]` (zero outside the
    draft vocabulary), which the sampling verification rules divide by.
    """
    logits, hidden = draft_forward(drafter, tokens_S, drafter.fuse(feats_SF[None])[0], start, cache)
    context = cache.length
    drafts: list[torch.Tensor] = []
    qs: list[torch.Tensor] = []
    pos = start + tokens_S.numel()
    for i in range(g):
        if i:
            logits, hidden = draft_forward(drafter, drafts[-1].view(1), hidden, pos, cache)
            pos += 1
        index, q_d = draw(logits[-1], sampling, generator)
        drafts.append(drafter.draft_to_target(torch.tensor(index, device=logits.device)))
        hidden = hidden[-1:]
        if q_d is not None:
            qs.append(_to_target_vocab(drafter, q_d))
    cache.crop(context)
    return Draft(torch.stack(drafts), torch.stack(qs) if qs else None)


def _to_target_vocab(drafter: Eagle3Drafter, q_Vd: torch.Tensor) -> torch.Tensor:
    """A draft-vocabulary distribution `[Vd]` laid out over the target vocabulary `[V]`."""
    q = q_Vd.new_zeros(drafter.t2d.numel())
    q[drafter.draft_to_target(torch.arange(q_Vd.numel(), device=q_Vd.device))] = q_Vd
    return q


class EagleProposer:
    """EAGLE-3's side of `draftsmith.drafters.speculative`: a chain of `g` drafts per round over a cached context."""

    def __init__(self, drafter: Eagle3Drafter, g: int) -> None:
        self.drafter, self.g, self.cache = drafter, g, DraftCache()
        self.feats: torch.Tensor | None = None
        self.tokens: torch.Tensor | None = None
        self.start = 0

    def prefill(self, features_SF: torch.Tensor, prompt_S: torch.Tensor, first: int) -> None:
        # The drafter pairs the taps at position p with the token at p + 1.
        self.feats, self.tokens = features_SF, torch.cat([prompt_S[1:], prompt_S.new_tensor([first])])

    def propose(self, last: int, sampling: Sampling, generator: torch.Generator) -> Draft:
        assert self.feats is not None and self.tokens is not None, "prefill comes first"
        draft = _draft_chain(self.drafter, self.feats, self.tokens, self.start, self.cache, self.g, sampling, generator)
        self.start += self.tokens.numel()
        return draft

    def accept(self, features_nF: torch.Tensor, emitted: list[int]) -> None:
        self.feats, self.tokens = features_nF, torch.tensor(emitted, dtype=torch.long, device=features_nF.device)


def speculative_generate(
    target: PreTrainedModel,
    drafter: Eagle3Drafter,
    taps: list[int],
    prompt_S: torch.Tensor,
    *,
    g: int,
    max_new: int,
    eos: set[int],
    sampling: Sampling = GREEDY,
    rule: Rule = "token",
    generator: torch.Generator | None = None,
) -> Decoded:
    """Speculative decoding of one prompt `[S]`; greedy output equals the target's greedy output."""
    proposer = EagleProposer(drafter, g)
    return speculative_decode(
        target, taps, proposer, prompt_S, max_new=max_new, eos=eos, sampling=sampling, rule=rule, generator=generator
    )


def greedy_generate(target: PreTrainedModel, prompt_S: torch.Tensor, *, max_new: int, eos: set[int]) -> Decoded:
    """Plain greedy decoding with a KV cache: the baseline."""
    return plain_decode(target, prompt_S, max_new=max_new, eos=eos)
