"""Unit tests for draftsmith.tasks.prompt_pool: synthetic pool, JSONL reading, dedupe and held-out split."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, cast

import pytest
from pydantic import ValidationError

from draftsmith.tasks.prompt_filters import exact_dedupe
from draftsmith.tasks.prompt_pool import CATEGORIES, PromptRecord, synthetic_pool

pytestmark = pytest.mark.unit


def _write_jsonl(path: Path, rows: list[object]) -> str:
    lines = [row if isinstance(row, str) else json.dumps(row, ensure_ascii=False) for row in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def _rec(rid: str, category: str, *turns: str, system: str | None = None) -> PromptRecord:
    return PromptRecord(id=rid, category=category, system=system, turns=list(turns))


# ---------------------------------------------------------------------------------------------- model


def test_record_is_frozen_and_forbids_extra_fields() -> None:
    record = _rec("a", "math", "What is 2 + 2?")
    with pytest.raises(ValidationError):
        cast(Any, record).id = "b"  # frozen: refused at run time
    with pytest.raises(ValidationError):
        extra: Any = {"answer": "4"}  # not a field: refused at run time
        PromptRecord(id="a", category="math", turns=["hi"], **extra)


@pytest.mark.parametrize(
    "fields",
    [
        {"id": "", "category": "math", "turns": ["hi"]},
        {"id": "  ", "category": "math", "turns": ["hi"]},
        {"id": "a", "category": "math", "turns": []},
        {"id": "a", "category": "math", "turns": ["hi", "   "]},
    ],
)
def test_record_rejects_blank_id_and_turns(fields: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        PromptRecord(**fields)


def test_blank_system_becomes_none() -> None:
    assert _rec("a", "math", "hi", system="  ").system is None


# ---------------------------------------------------------------------------------------- synthetic


def test_same_seed_gives_same_pool_and_other_seed_differs() -> None:
    first = synthetic_pool(300, seed=7)
    assert first == synthetic_pool(300, seed=7)
    assert [r.id for r in first] != [r.id for r in synthetic_pool(300, seed=8)]


def test_pool_does_not_touch_global_random_state() -> None:
    import random

    random.seed(123)
    expected = random.random()
    random.seed(123)
    synthetic_pool(50, seed=1)
    assert random.random() == expected


def test_default_mix_is_equal_and_every_category_present() -> None:
    pool = synthetic_pool(100 * len(CATEGORIES), seed=0)
    assert len(pool) == 100 * len(CATEGORIES)
    assert Counter(r.category for r in pool) == dict.fromkeys(CATEGORIES, 100)


def test_mix_proportions_follow_largest_remainder() -> None:
    pool = synthetic_pool(101, seed=3, mix={"math": 0.5, "coding": 0.25, "dialogue": 0.25})
    counts = Counter(r.category for r in pool)
    # Quotas 50.5, 25.25, 25.25: the largest remainder (math) takes the leftover seat.
    assert counts == {"math": 51, "coding": 25, "dialogue": 25}


def test_mix_with_zero_weight_excludes_category() -> None:
    pool = synthetic_pool(97, seed=3, mix={c: (0.0 if c == "writing" else 1.0) for c in CATEGORIES})
    counts = Counter(r.category for r in pool)
    assert "writing" not in counts
    assert sum(counts.values()) == 97
    assert max(counts.values()) - min(counts.values()) <= 1


def test_pool_is_shuffled_not_grouped_by_category() -> None:
    categories = [r.category for r in synthetic_pool(120, seed=5)]
    changes = sum(a != b for a, b in zip(categories, categories[1:], strict=False))
    assert changes > 30


@pytest.mark.parametrize(
    ("mix", "match"),
    [
        ({"math": 1.0, "poetry": 1.0}, "'poetry'"),
        ({"math": -1.0}, "'math'"),
        ({"math": 0.0, "coding": 0.0}, "all be zero"),
        ({"math": float("nan")}, "'math'"),
    ],
)
def test_invalid_mix_raises(mix: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        synthetic_pool(10, seed=0, mix=mix)


def test_negative_count_raises_and_zero_is_empty() -> None:
    with pytest.raises(ValueError, match="num_prompts"):
        synthetic_pool(-1, seed=0)
    assert synthetic_pool(0, seed=0) == []


@pytest.fixture(scope="module")
def big_pool() -> list[PromptRecord]:
    return synthetic_pool(2000, seed=42)


def test_pool_is_diverse(big_pool: list[PromptRecord]) -> None:
    _, dropped = exact_dedupe(big_pool)
    assert dropped / len(big_pool) < 0.02
    # Beyond exact duplicates: openings vary, so the pool is not a handful of templates.
    openings = Counter(" ".join(r.turns[0].split()[:3]) for r in big_pool)
    assert len(openings) > 200
    assert openings.most_common(1)[0][1] / len(big_pool) < 0.15


def test_ids_are_unique_and_content_derived(big_pool: list[PromptRecord]) -> None:
    assert len({r.id for r in big_pool}) == len(big_pool)
    for record in big_pool[:50]:
        assert record.id.startswith(f"syn-{record.category}-")
    # The same text draws the same id whatever the seed, so duplicates across pools are detectable.
    ids_a = {r.id: r.turns for r in big_pool}
    shared = [r for r in synthetic_pool(2000, seed=43) if r.id in ids_a]
    assert all(ids_a[r.id] == r.turns for r in shared)


def test_every_category_has_its_shape(big_pool: list[PromptRecord]) -> None:
    by_category: dict[str, list[PromptRecord]] = {}
    for record in big_pool:
        by_category.setdefault(record.category, []).append(record)
    assert set(by_category) == set(CATEGORIES)
    assert all(len(r.turns) in (2, 3) for r in by_category["dialogue"])
    assert all(len(r.turns) == 2 for r in by_category["followup"])
    assert all(len(r.turns) == 1 for c in CATEGORIES if c not in ("dialogue", "followup") for r in by_category[c])
    assert all(any(ch.isdigit() for ch in r.turns[0]) for c in ("math", "extraction") for r in by_category[c])
    # The reuse categories carry the material their answers reuse: code, or a text of several sentences.
    assert all("```" in r.turns[0] for r in by_category["completion"])
    assert all(r.turns[0].count(". ") >= 2 for r in by_category["editing"])
    # Multilingual prompts include text outside ASCII (accents, CJK) or name the target language.
    assert sum(not r.turns[0].isascii() for r in by_category["multilingual"]) > 30


def test_system_prompt_rate_is_about_a_fifth(big_pool: list[PromptRecord]) -> None:
    rate = sum(r.system is not None for r in big_pool) / len(big_pool)
    assert 0.15 < rate < 0.25


def test_prompts_are_short(big_pool: list[PromptRecord]) -> None:
    english = [r for r in big_pool if r.category != "multilingual"]
    words = [len(" ".join(r.turns).split()) for r in english]
    assert sum(8 <= n <= 60 for n in words) / len(words) > 0.9
    assert max(words) <= 80
