"""The speculative decoding loop shared by every drafter family: an HF target with a KV cache, batch 1.

A family supplies a `Proposer` (its drafter and caches); this loop owns the target. Each round: the
proposer drafts g tokens (greedy at temperature 0, else sampled, keeping the distributions q they were
sampled from), an optional truncation shortens the draft (DSpark's dynamic verification), the target
scores `[last token, drafts]` in one forward, a rule from `draftsmith.drafters.verify` decides what is emitted, the
target cache is cropped to the verified length and the proposer extends its context with the verified
positions' taps. Greedy verification reproduces plain greedy decoding exactly; the sampling rules
reproduce the target's sampling distribution (tested in `tests/unit/test_verify.py`).

Shape legend: S prompt length, g drafts, V target vocabulary, F = N*Ht fused taps.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import PreTrainedModel

from draftsmith.drafters.verify import Rule, Sampling, greedy_verify, verify, warp
from draftsmith.engines.hf import TapRecorder


@dataclass(frozen=True)
class Draft:
    """One round's drafts `[g]` (target ids), the distributions `[g, V]` they were sampled from (None when
    greedy) and, for DSpark, the confidence head's logits `[g]`."""

    tokens: torch.Tensor
    q: torch.Tensor | None = None
    confidence: torch.Tensor | None = None

    def head(self, n: int) -> "Draft":
        """The first `n` drafts (dynamic verification keeps a prefix)."""
        cut = lambda t: None if t is None else t[:n]  # noqa: E731
        return Draft(self.tokens[:n], cut(self.q), cut(self.confidence))


class Proposer(Protocol):
    """A drafter's side of the loop."""

    def prefill(self, features_SF: torch.Tensor, prompt_S: torch.Tensor, first: int) -> None:
        """Take the prompt's taps `[S, F]`; `first` is the target's first generated token."""

    def propose(self, last: int, sampling: Sampling, generator: torch.Generator) -> Draft:
        """Draft after the verified token `last`."""

    def accept(self, features_nF: torch.Tensor, emitted: list[int]) -> None:
        """Extend the context by the verified positions: taps `[n, F]` of `[last, accepted drafts]`;
        `emitted` are the n tokens that follow them."""


@dataclass
class Decoded:
    """One generation and its acceptance statistics (all zero for the plain baseline)."""

    tokens: list[int]
    seconds: float
    rounds: int = 0
    accepted: int = 0
    drafted: int = 0
    accept_hist: list[int] = field(default_factory=list)  # rounds with k drafts accepted, k = 0..g
    position_tries: list[int] = field(default_factory=list)  # rounds that verified draft position k
    position_accepts: list[int] = field(default_factory=list)  # ... and accepted it
    confidence: list[tuple[list[float], int]] = field(default_factory=list)  # (logits per slot, accepted)
    round_accepts: list[int] = field(default_factory=list)  # drafts accepted in each round, in order

    def record(self, draft: Draft, n_acc: int) -> None:
        g = draft.tokens.numel()
        self.rounds, self.accepted, self.drafted = self.rounds + 1, self.accepted + n_acc, self.drafted + g
        for lst, size in ((self.accept_hist, g + 1), (self.position_tries, g), (self.position_accepts, g)):
            lst.extend([0] * (size - len(lst)))
        self.accept_hist[n_acc] += 1
        self.round_accepts.append(n_acc)
        for k in range(min(g, n_acc + 1)):
            self.position_tries[k] += 1
            self.position_accepts[k] += int(k < n_acc)
        if draft.confidence is not None:
            self.confidence.append((draft.confidence.float().tolist(), n_acc))


def _stop(tokens: list[int], eos: set[int], max_new: int) -> list[int]:
    """Cut at the first end-of-turn token (kept) or at `max_new` tokens."""
    for i, t in enumerate(tokens[:max_new]):
        if t in eos:
            return tokens[: i + 1]
    return tokens[:max_new]


def is_greedy(sampling: Sampling) -> bool:
    return sampling.temperature == 0


def draw(
    logits_V: torch.Tensor, sampling: Sampling, generator: torch.Generator | None
) -> tuple[int, torch.Tensor | None]:
    """The argmax (greedy) or a sample of `warp(logits)`, with that distribution `[V]` (None when greedy)."""
    if is_greedy(sampling):
        return int(logits_V.argmax()), None
    probs = warp(logits_V[None].float(), sampling)[0]
    return int(torch.multinomial(probs, 1, generator=generator)), probs


Truncate = Callable[[Draft], int]
GREEDY = Sampling()


@torch.inference_mode()
def speculative_decode(
    target: PreTrainedModel,
    taps: list[int],
    proposer: Proposer,
    prompt_S: torch.Tensor,
    *,
    max_new: int,
    eos: set[int],
    sampling: Sampling = GREEDY,
    rule: Rule = "token",
    generator: torch.Generator | None = None,
    truncate: Truncate | None = None,
) -> Decoded:
    """Speculative decoding of one prompt `[S]`. `rule` (token | block) applies when sampling; greedy
    sampling always verifies greedily. `truncate(draft) -> n` keeps the first n drafts (n >= 0)."""
    # `draw` and the verification rules sample on the logits' device, so the default generator lives there.
    generator = generator or torch.Generator(device=prompt_S.device).manual_seed(0)
    start_time = time.perf_counter()
    rec = TapRecorder(target, taps)
    with rec:
        out = target(input_ids=prompt_S[None], use_cache=True)
    cache = out.cache
    generated = [draw(out.logits[0, -1], sampling, generator)[0]]
    proposer.prefill(rec.features_BSF()[0].float(), prompt_S, generated[0])
    result = Decoded(tokens=[], seconds=0.0)
    while not eos.intersection(generated) and len(generated) < max_new:
        draft = proposer.propose(generated[-1], sampling, generator)
        if truncate is not None:
            draft = draft.head(truncate(draft))
        g = draft.tokens.numel()
        anchor = prompt_S.new_tensor(generated[-1:])
        with rec:
            out = target(
                input_ids=torch.cat([anchor, draft.tokens.to(prompt_S.dtype)])[None], cache=cache, use_cache=True
            )
        logits = out.logits[0].float()  # [g + 1, V]
        if is_greedy(sampling):
            n_acc, emitted = greedy_verify(draft.tokens, logits.argmax(-1))
        else:
            verdict = verify(rule, draft.tokens, draft.q, warp(logits, sampling), generator)
            n_acc, emitted = verdict.accepted, verdict.tokens
        if n_acc < g:
            cache.crop(-(g - n_acc))
        proposer.accept(rec.features_BSF()[0, : n_acc + 1].float(), emitted)
        result.record(draft, n_acc)
        generated.extend(emitted)
    result.tokens, result.seconds = _stop(generated, eos, max_new), time.perf_counter() - start_time
    return result


@torch.inference_mode()
def plain_decode(
    target: PreTrainedModel,
    prompt_S: torch.Tensor,
    *,
    max_new: int,
    eos: set[int],
    sampling: Sampling = GREEDY,
    generator: torch.Generator | None = None,
) -> Decoded:
    """The baseline: one target forward per token with a KV cache, greedy or sampled alike."""
    # `draw` and the verification rules sample on the logits' device, so the default generator lives there.
    generator = generator or torch.Generator(device=prompt_S.device).manual_seed(0)
    start_time = time.perf_counter()
    out = target(input_ids=prompt_S[None], use_cache=True)
    cache, generated = out.cache, [draw(out.logits[0, -1], sampling, generator)[0]]
    while generated[-1] not in eos and len(generated) < max_new:
        out = target(input_ids=prompt_S.new_tensor(generated[-1:])[None], cache=cache, use_cache=True)
        generated.append(draw(out.logits[0, -1], sampling, generator)[0])
    return Decoded(_stop(generated, eos, max_new), time.perf_counter() - start_time)
