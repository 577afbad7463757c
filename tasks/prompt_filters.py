"""Choosing prompts: exact and near deduplication, token-length limits, n-gram decontamination, the
category mix and the exact, stratified held-out split.

Every filter keeps the earlier record of a tie (source order is priority order) and returns what it
dropped, so the stage can account for every row it read. Nothing here compares all pairs: near
duplicates go through MinHash LSH and contamination through a hashed n-gram set, both linear in the pool.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

from datasketch import MinHash, MinHashLSH

from draftsmith.core.prompt_keys import dedupe_key
from draftsmith.tasks.prompt_pool import PromptRecord, allocate

_WORD = re.compile(r"\w+")


def words(text: str) -> list[str]:
    """Casefolded word tokens; punctuation and spacing differences do not make prompts distinct."""
    return _WORD.findall(text.casefold())


def user_words(record: PromptRecord) -> list[str]:
    # System prompts are shared boilerplate in most corpora; comparing them would make unrelated prompts
    # look alike, so similarity and contamination are judged on the user turns.
    return words("\n".join(record.turns))


def exact_dedupe(records: Sequence[PromptRecord]) -> tuple[list[PromptRecord], int]:
    """Drop records whose system + turns equal an earlier one's after whitespace and case folding."""
    seen: set[str] = set()
    kept = []
    for record in records:
        key = dedupe_key(record.system, record.turns)
        if key not in seen:
            seen.add(key)
            kept.append(record)
    return kept, len(records) - len(kept)


def prompt_texts(record: PromptRecord) -> str:
    """The text whose tokens count towards the prompt length: system, turns and tool definitions."""
    import json

    parts = [record.system or "", *record.turns]
    if record.tools:
        parts.append(json.dumps(record.tools, ensure_ascii=False, sort_keys=True))
    return "\n".join(p for p in parts if p)


def token_lengths(records: Sequence[PromptRecord], count_tokens: Callable[[list[str]], list[int]]) -> list[int]:
    """Prompt length of each record in tokens: system, turns and tool definitions (`prompt_texts`)."""
    return count_tokens([prompt_texts(r) for r in records]) if records else []


def length_filter(
    records: Sequence[PromptRecord],
    count_tokens: Callable[[list[str]], list[int]],
    *,
    min_tokens: int,
    max_tokens: int | None,
    lengths: Sequence[int] | None = None,
) -> tuple[list[PromptRecord], int, int]:
    """Keep records with `min_tokens <= tokens <= max_tokens`.

    Args:
        records: Candidates.
        count_tokens: Token counts of a batch of texts (the target's tokenizer, no special tokens).
        min_tokens: Inclusive lower bound.
        max_tokens: Inclusive upper bound, or None for none.
        lengths: The records' `token_lengths`, when already counted.

    Returns:
        `(kept, too_short, too_long)`.
    """
    if lengths is None:
        lengths = token_lengths(records, count_tokens)
    kept, short, long = [], 0, 0
    for record, n in zip(records, lengths, strict=True):
        if n < min_tokens:
            short += 1
        elif max_tokens is not None and n > max_tokens:
            long += 1
        else:
            kept.append(record)
    return kept, short, long


# Where model configs state their context window, most common first.
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def context_length(model_config: dict) -> int | None:
    """The context window a model's config.json declares (in `text_config` for multimodal models), or None."""
    for section in (model_config, model_config.get("text_config")):
        if not isinstance(section, dict):
            continue
        for key in _CONTEXT_KEYS:
            value = section.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def split_over_context(
    records: Sequence[PromptRecord], lengths: Sequence[int], *, context: int, answer_tokens: int
) -> tuple[list[PromptRecord], list[int], list[tuple[PromptRecord, int, int]]]:
    """Set apart the prompts that leave no room in the target's `context` for their answers.

    Each turn is answered with up to `answer_tokens`, and the whole conversation must fit, so a prompt's
    bound is `context - answer_tokens * turns`.

    Returns:
        `(kept, kept_lengths, over)`, `over` holding `(record, tokens, bound)`.
    """
    kept, kept_lengths, over = [], [], []
    for record, n in zip(records, lengths, strict=True):
        bound = context - answer_tokens * len(record.turns)
        if n > bound:
            over.append((record, n, bound))
        else:
            kept.append(record)
            kept_lengths.append(n)
    return kept, kept_lengths, over


def shingles(tokens: list[str], size: int) -> set[bytes]:
    """Word `size`-grams; a text shorter than `size` words is one shingle of all its words."""
    if len(tokens) <= size:
        return {" ".join(tokens).encode()}
    return {" ".join(tokens[i : i + size]).encode() for i in range(len(tokens) - size + 1)}


_DEDUPE_BATCH = 4096  # records hashed at once: large enough for MinHash.bulk, small enough for a live count


def near_dedupe(
    records: Sequence[PromptRecord],
    *,
    threshold: float,
    num_perm: int,
    shingle_size: int,
    done: Callable[[int], None] | None = None,
) -> tuple[list[PromptRecord], int]:
    """Drop records whose user turns are near duplicates (estimated Jaccard >= threshold) of an earlier one.

    LSH only proposes candidates; each is confirmed on the MinHash estimate, so the banding's false
    positives do not remove distinct prompts. Linear in the number of records; `done(n)` after every n
    records checked.

    Returns:
        `(kept, dropped)`.
    """
    lsh = MinHashLSH(threshold=threshold, num_perm=num_perm)
    kept_hashes: dict[int, MinHash] = {}
    kept = []
    for start in range(0, len(records), _DEDUPE_BATCH):
        batch = records[start : start + _DEDUPE_BATCH]
        hashes = MinHash.bulk([list(shingles(user_words(r), shingle_size)) for r in batch], num_perm=num_perm, seed=1)
        for index, (record, mh) in enumerate(zip(batch, hashes, strict=True), start):
            if any(kept_hashes[k].jaccard(mh) >= threshold for k in lsh.query(mh)):
                continue
            lsh.insert(index, mh)
            kept_hashes[index] = mh
            kept.append(record)
        if done is not None:
            done(len(batch))
    return kept, len(records) - len(kept)


def ngram_index(texts: Sequence[str], n: int) -> set[int]:
    """Hashed word n-grams of reference texts; a text shorter than n words adds itself whole."""
    grams: set[int] = set()
    for text in texts:
        grams.update(_ngrams(words(text), n))
    return grams


def _ngrams(tokens: list[str], n: int) -> set[int]:
    if not tokens:
        return set()
    if len(tokens) <= n:
        return {hash(tuple(tokens))}
    return {hash(tuple(tokens[i : i + n])) for i in range(len(tokens) - n + 1)}


def contaminated(record: PromptRecord, index: set[int], n: int) -> bool:
    """Whether any user turn shares a word n-gram (or, if short, its whole text) with the index."""
    return any(not index.isdisjoint(_ngrams(words(turn), n)) for turn in record.turns)


@dataclass
class Selection:
    """The chosen prompts and what the choice dropped."""

    train: list[PromptRecord]
    eval: list[PromptRecord]
    contaminated: int = 0
    over_quota: int = 0
    shortfall: dict[str, int] = field(default_factory=dict)


def choose(
    records: Sequence[PromptRecord],
    *,
    num_prompts: int,
    num_eval: int,
    mix: dict[str, float] | None,
    seed: int,
    ngram: int,
) -> Selection:
    """Pick `num_prompts` by category quota, hold out exactly `num_eval`, and decontaminate train.

    Each category is shuffled with its own seeded RNG. Its first `eval` records go to eval (eval is
    stratified over the categories' quotas); train then takes the next records that share no n-gram
    with any eval prompt, until the category's train quota is met, so contamination does not shrink
    train while candidates last. Both splits keep input order.

    Raises:
        ValueError: When fewer than `num_eval + 1` prompts can be chosen.
    """
    pools: dict[str, list[int]] = {}
    for i, record in enumerate(records):
        pools.setdefault(record.category, []).append(i)
    weights = {c: Fraction(len(ix)) for c, ix in pools.items()}
    if mix is not None:
        weights = {c: Fraction(mix.get(c, 0)) for c in sorted(set(pools) | set(mix))}
    quotas = allocate(num_prompts if mix is not None else min(num_prompts, len(records)), weights)
    shortfall = {c: q - len(pools.get(c, [])) for c, q in quotas.items() if q > len(pools.get(c, []))}
    sizes = {c: min(q, len(pools.get(c, []))) for c, q in quotas.items()}
    if sum(sizes.values()) <= num_eval:
        raise ValueError(
            f"select.num_eval: only {sum(sizes.values())} prompts are left after filtering, not enough for "
            f"select.num_eval={num_eval} plus training"
        )
    eval_quota = allocate(num_eval, {c: Fraction(n) for c, n in sizes.items()})
    shuffled = {c: _shuffled(ix, seed, c) for c, ix in pools.items()}
    held = {i for c, ix in shuffled.items() for i in ix[: eval_quota.get(c, 0)]}
    index = ngram_index([t for i in held for t in records[i].turns], ngram)
    train: set[int] = set()
    dirty = 0
    for c, ix in shuffled.items():
        want = sizes.get(c, 0) - eval_quota.get(c, 0)
        for i in ix[eval_quota.get(c, 0) :]:
            if want == 0:
                break
            if contaminated(records[i], index, ngram):
                dirty += 1
                continue
            train.add(i)
            want -= 1
        if want:
            shortfall[c] = shortfall.get(c, 0) + want
    return Selection(
        train=[r for i, r in enumerate(records) if i in train],
        eval=[r for i, r in enumerate(records) if i in held],
        contaminated=dirty,
        over_quota=len(records) - len(train) - len(held) - dirty,
        shortfall=shortfall,
    )


def _shuffled(indices: list[int], seed: int, category: str) -> list[int]:
    # A str seed hashes stably (unlike hash()), and a per-category RNG keeps one category's draw
    # independent of how many records the others have.
    out = list(indices)
    random.Random(f"{seed}:{category}").shuffle(out)
    return out
