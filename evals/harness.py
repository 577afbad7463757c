"""Run a drafter over benchmark prompts: speculative and plain decoding side by side, acceptance statistics.

For every prompt and turn, the target first answers with plain decoding (the baseline, and the answer the
next turn of a multi-turn item is conditioned on: the target regenerates each turn), then the drafter
decodes the same turn speculatively with the same sampling settings. At temperature 0 the two outputs must
be equal token for token; at temperature > 0 they are two samples of one distribution (the verification
rules' losslessness is proven statistically in `tests/unit/test_verify.py`). Seeds are derived from
(seed, prompt id, turn), so a table is reproducible to the digit.

Shape legend: S prompt length.
"""

import functools
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from draftsmith.drafters.speculative import Decoded, Proposer, Truncate, plain_decode
from draftsmith.drafters.speculative_batch import plain_decode_batch, speculative_decode_batch
from draftsmith.drafters.verify import Sampling
from draftsmith.evals.records import BenchPrompt


@dataclass(frozen=True)
class EvalSettings:
    """How to decode: sampling, verification rule, tokens per turn, drafts per round and the seed."""

    sampling: Sampling
    rule: str
    max_new_tokens: int
    g: int
    seed: int = 0
    batch_size: int = 1


Generate = Callable[..., Decoded]  # family.generate bound to (target, drafter, taps)


@dataclass(frozen=True)
class Decoder:
    """How one drafter decodes: `one(prompt_S, ...)` at batch 1 (the reference loop) and, for batches,
    `proposer()`: a fresh per-row drafting state for `draftsmith.drafters.speculative_batch`."""

    one: Generate
    taps: list[int]
    proposer: Callable[[], Proposer]
    truncate: Truncate | None = None

    def with_truncate(self, truncate: Truncate) -> "Decoder":
        return Decoder(functools.partial(self.one, truncate=truncate), self.taps, self.proposer, truncate)

    def many(self, target: PreTrainedModel, prompts: list[torch.Tensor], **how) -> list[Decoded]:
        props = [self.proposer() for _ in prompts]
        return speculative_decode_batch(target, self.taps, props, prompts, truncate=self.truncate, **how)


def turn_ids(tok: PreTrainedTokenizerBase, prompt: BenchPrompt, answers: list[str], turn: int) -> torch.Tensor:
    """Turn `turn`'s input `[S]`: the system prompt, earlier turns with the target's answers, this user turn."""
    msgs = [{"role": "system", "content": prompt.system}] if prompt.system else []
    for i in range(turn):
        msgs += [{"role": "user", "content": prompt.turns[i]}, {"role": "assistant", "content": answers[i]}]
    msgs.append({"role": "user", "content": prompt.turns[turn]})
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    return torch.tensor(tok(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def _seed(seed: int, prompt_id: str, turn: int, what: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(f"{seed}:{prompt_id}:{turn}:{what}".encode()))


def run_prompts(
    target: PreTrainedModel,
    tok: PreTrainedTokenizerBase,
    decoder: Decoder,
    prompts: list[BenchPrompt],
    settings: EvalSettings,
    eos: set[int],
    done: Callable[[int], None] | None = None,
) -> list[dict]:
    """One row per (prompt, turn): tokens, rounds, accepted, histograms, timings, identical-to-baseline.
    Prompts go `settings.batch_size` at a time; a multi-turn group decodes turn by turn; `done(n)` after
    each group of n prompts."""
    rows = []
    for i in range(0, len(prompts), max(1, settings.batch_size)):
        group = prompts[i : i + settings.batch_size]
        rows += _run_group(target, tok, decoder, group, settings, eos)
        if done is not None:
            done(len(group))
    order = {p.id: k for k, p in enumerate(prompts)}
    return sorted(rows, key=lambda r: (order[r["id"]], r["turn"]))


def _run_group(target, tok, decoder: Decoder, group: list[BenchPrompt], s: EvalSettings, eos: set[int]) -> list[dict]:
    answers: dict[str, list[str]] = {p.id: [] for p in group}
    rows = []
    for turn in range(max(len(p.turns) for p in group)):
        members = [p for p in group if len(p.turns) > turn]
        ids = [turn_ids(tok, p, answers[p.id], turn) for p in members]
        g_base = [_seed(s.seed, p.id, turn, "base") for p in members]
        g_spec = [_seed(s.seed, p.id, turn, "spec") for p in members]
        how: dict[str, Any] = {"max_new": s.max_new_tokens, "eos": eos, "sampling": s.sampling}
        if len(members) == 1:
            base = [plain_decode(target, ids[0], generator=g_base[0], **how)]
            spec = [decoder.one(ids[0], rule=s.rule, generator=g_spec[0], **how)]
        else:
            base = plain_decode_batch(target, ids, generators=g_base, **how)
            spec = decoder.many(target, ids, rule=s.rule, generators=g_spec, **how)
        for p, prompt, b, sp in zip(members, ids, base, spec, strict=True):
            answers[p.id].append(tok.decode(b.tokens, skip_special_tokens=True))
            # A batch's rows share its wall time: each row is charged its share, so sums stay wall time.
            b.seconds, sp.seconds = b.seconds / len(members), sp.seconds / len(members)
            rows.append(_row(p, turn, b, sp) | {"prompt_tokens": len(prompt), "prompt_ids": prompt.tolist()})
    return rows


def _row(prompt: BenchPrompt, turn: int, base: Decoded, spec: Decoded) -> dict:
    return {
        "id": prompt.id,
        "category": prompt.category,
        "turn": turn,
        "tokens": len(spec.tokens),
        "baseline_tokens": len(base.tokens),
        "rounds": spec.rounds,
        "accepted": spec.accepted,
        "drafted": spec.drafted,
        "accept_hist": spec.accept_hist,
        "position_tries": spec.position_tries,
        "position_accepts": spec.position_accepts,
        # Per round, in order: with `prompt_tokens` they place each round at its context length (`draftsmith doctor`).
        "round_accepts": spec.round_accepts,
        "confidence": spec.confidence,
        "identical": spec.tokens == base.tokens,
        "output_ids": spec.tokens,
        "baseline_seconds": base.seconds,
        "speculative_seconds": spec.seconds,
    }


def _sum_lists(lists: list[list[int]]) -> list[int]:
    out = [0] * max((len(x) for x in lists), default=0)
    for x in lists:
        for i, v in enumerate(x):
            out[i] += v
    return out


def summarise_bench(bench: str, drafter: str, rows: list[dict], settings: EvalSettings) -> dict:
    """The per-benchmark result: acc_len = 1 + accepted/rounds, per-position conditional acceptance,
    acceptance histogram, verify rate (target verification forwards per generated token) and tokens/s."""
    rounds, accepted = sum(r["rounds"] for r in rows), sum(r["accepted"] for r in rows)
    tries, accepts = _sum_lists([r["position_tries"] for r in rows]), _sum_lists([r["position_accepts"] for r in rows])
    tokens = sum(r["tokens"] for r in rows)
    return {
        "bench": bench,
        "drafter": drafter,
        "temperature": settings.sampling.temperature,
        "top_p": settings.sampling.top_p,
        "rule": settings.rule if settings.sampling.temperature else "greedy",
        "draft_tokens_per_round": settings.g,
        "prompts": len({r["id"] for r in rows}),
        "turns": len(rows),
        "acc_len": round(1.0 + accepted / max(1, rounds), 4),
        "rounds": rounds,
        "accepted": accepted,
        "accept_hist": _sum_lists([r["accept_hist"] for r in rows]),
        "position_accept": [round(a / t, 4) if t else 0.0 for a, t in zip(accepts, tries, strict=True)],
        "verify_rate": round(rounds / max(1, tokens), 4),
        "tokens_per_s": {
            "baseline": round(sum(r["baseline_tokens"] for r in rows) / sum(r["baseline_seconds"] for r in rows), 3),
            "speculative": round(tokens / sum(r["speculative_seconds"] for r in rows), 3),
        },
        "mismatched_outputs": sum(not r["identical"] for r in rows) if not settings.sampling.temperature else None,
    }


def run_benches(
    target: PreTrainedModel,
    tok: PreTrainedTokenizerBase,
    decoder: Decoder,
    benches: dict[str, list[BenchPrompt]],
    settings: EvalSettings,
    eos: set[int],
    drafter: str,
    done: Callable[[int], None] | None = None,
) -> tuple[list[dict], list[dict]]:
    """Per-benchmark results and every row (with its `bench`); `done(n)` after every n prompts decoded."""
    warm = next(iter(benches.values()))[0]
    plain_decode(target, turn_ids(tok, warm, [], 0), max_new=4, eos=eos)  # first-call costs out of the timings
    results, all_rows = [], []
    for name, prompts in benches.items():
        start = time.perf_counter()
        rows = run_prompts(target, tok, decoder, prompts, settings, eos, done)
        result = summarise_bench(name, drafter, rows, settings) | {"seconds": round(time.perf_counter() - start, 2)}
        results.append(result)
        all_rows += [r | {"bench": name} for r in rows]
    return results, all_rows
