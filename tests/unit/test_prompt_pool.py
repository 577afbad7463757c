"""Unit tests for draftsmith.tasks.prompt_pool: synthetic pool, JSONL reading, dedupe and held-out split."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from pydantic import ValidationError

from draftsmith.tasks.prompt_pool import CATEGORIES, PromptRecord, synthetic_pool
from draftsmith.tasks.prompt_sources import dedupe, read_prompts_jsonl, split_heldout

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
        record.id = "b"  # type: ignore[misc]
    with pytest.raises(ValidationError):
        PromptRecord(id="a", category="math", turns=["hi"], answer="4")  # type: ignore[call-arg]


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
    pool = synthetic_pool(600, seed=0)
    assert len(pool) == 600
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
    _, dropped = dedupe(big_pool)
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
    assert all(len(r.turns) == 1 for c in CATEGORIES if c != "dialogue" for r in by_category[c])
    assert all(any(ch.isdigit() for ch in r.turns[0]) for r in by_category["math"])
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


# -------------------------------------------------------------------------------------------- jsonl


def test_reads_all_three_row_shapes(tmp_path: Path) -> None:
    path = _write_jsonl(
        tmp_path / "prompts.jsonl",
        [
            {"id": "t1", "category": "math", "system": "Be brief.", "turns": ["What is 2+2?", "And 3+3?"]},
            "",
            {"prompt": "Tell me a joke."},
            {
                "category": "chat",
                "messages": [
                    {"role": "system", "content": "You are kind."},
                    {"role": "user", "content": "Hi!"},
                    {"role": "assistant", "content": "Hello!"},
                    {"role": "user", "content": "How are you?"},
                ],
            },
        ],
    )
    records = read_prompts_jsonl(path)
    assert records == [
        PromptRecord(id="t1", category="math", system="Be brief.", turns=["What is 2+2?", "And 3+3?"]),
        PromptRecord(id="prompts.jsonl-3", category="file", turns=["Tell me a joke."]),
        PromptRecord(id="prompts.jsonl-4", category="chat", system="You are kind.", turns=["Hi!", "How are you?"]),
    ]


def test_reads_via_fsspec_url(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Hello there, how are you?"}])
    assert read_prompts_jsonl(f"file://{path}")[0].turns == ["Hello there, how are you?"]


def test_unicode_is_preserved(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "为什么海水是咸的？"}])
    assert read_prompts_jsonl(path)[0].turns == ["为什么海水是咸的？"]


@pytest.mark.parametrize(
    ("bad_row", "problem"),
    [
        ('{"turns": ["ok"', "invalid JSON"),
        ('["not", "an", "object"]', "must be a JSON object"),
        ({"id": "x"}, "exactly one of 'turns', 'prompt' or 'messages'"),
        ({"turns": []}, "field 'turns' must be a non-empty list of strings"),
        ({"turns": "just a string"}, "field 'turns' must be a non-empty list of strings"),
        ({"turns": ["fine", 3]}, "field 'turns' must be a non-empty list of strings"),
        ({"turns": ["fine", "   "]}, "field 'turns' must be a non-empty list of strings"),
        ({"prompt": ""}, "field 'prompt' must be a non-empty string"),
        ({"prompt": 42}, "field 'prompt' must be a non-empty string"),
        ({"prompt": "a", "turns": ["b"]}, "exactly one of"),
        ({"messages": [{"role": "user", "content": ["part"]}]}, "messages[0].content must be"),
        ({"messages": [{"role": "user", "content": None}]}, "messages[0].content must be"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0] needs role"),
        ({"messages": [{"role": "assistant", "content": "x"}]}, "no user message"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]}, "after a"),
        (
            {
                "system": "s",
                "messages": [{"role": "system", "content": "t"}, {"role": "user", "content": "u"}],
            },
            "keep one",
        ),
        ({"id": 5, "prompt": "hi"}, "field 'id' must be a non-empty string"),
        ({"category": "", "prompt": "hi"}, "field 'category' must be a non-empty string"),
        ({"system": 1, "prompt": "hi"}, "field 'system' must be a string"),
    ],
)
def test_bad_row_names_file_line_and_problem(tmp_path: Path, bad_row: object, problem: str) -> None:
    path = _write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "first"}, "", {"prompt": "third"}, bad_row])
    with pytest.raises(ValueError) as excinfo:
        read_prompts_jsonl(path)
    message = str(excinfo.value)
    assert message.startswith(f"{path}:4: ")
    assert "prompts.jsonl:4:" in message
    assert problem in message


def test_duplicate_ids_in_file_raise(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "x"}, {"id": "a", "prompt": "y"}])
    with pytest.raises(ValueError, match=r"p\.jsonl:2: duplicate id 'a' \(first on line 1\)"):
        read_prompts_jsonl(path)


def test_empty_system_message_is_dropped(tmp_path: Path) -> None:
    rows = [{"messages": [{"role": "system", "content": ""}, {"role": "user", "content": "Hi"}]}]
    record = read_prompts_jsonl(_write_jsonl(tmp_path / "p.jsonl", rows))[0]
    assert record.system is None
    assert record.turns == ["Hi"]


# ------------------------------------------------------------------------------------- dedupe/split


def test_dedupe_keeps_first_and_counts_dropped() -> None:
    records = [
        _rec("a", "x", "Hello   World"),
        _rec("b", "x", "hello world"),
        _rec("c", "x", "hello world", system="Be brief."),
        _rec("d", "x", "hello", "world"),
        _rec("e", "x", "  HELLO WORLD\n"),
        _rec("f", "x", "hello world", system="be   BRIEF."),
    ]
    kept, dropped = dedupe(records)
    assert [r.id for r in kept] == ["a", "c", "d"]
    assert dropped == 3
    assert dedupe([]) == ([], 0)


def _stratified_records() -> list[PromptRecord]:
    sizes = {"math": 40, "coding": 20, "writing": 3, "tiny": 2, "single": 1}
    return [_rec(f"{cat}-{i}", cat, f"{cat} prompt {i}") for cat, n in sizes.items() for i in range(n)]


def test_split_is_stratified_disjoint_and_complete() -> None:
    records = _stratified_records()
    train, held = split_heldout(records, eval_fraction=0.1, seed=0)
    held_counts = Counter(r.category for r in held)
    assert held_counts == {"math": 4, "coding": 2, "writing": 1, "tiny": 1}
    assert not {r.id for r in train} & {r.id for r in held}
    assert len(train) + len(held) == len(records)
    # Train keeps every category with at least two records.
    assert {r.category for r in train} == {"math", "coding", "writing", "tiny", "single"}


def test_split_preserves_input_order_and_is_deterministic() -> None:
    records = _stratified_records()
    position = {r.id: i for i, r in enumerate(records)}
    train, held = split_heldout(records, eval_fraction=0.2, seed=11)
    for part in (train, held):
        assert [position[r.id] for r in part] == sorted(position[r.id] for r in part)
    assert (train, held) == split_heldout(records, eval_fraction=0.2, seed=11)
    assert held != split_heldout(records, eval_fraction=0.2, seed=12)[1]


def test_split_min_eval_per_category_and_zero_fraction() -> None:
    records = _stratified_records()
    _, held = split_heldout(records, eval_fraction=0.0, seed=0, min_eval_per_category=3)
    # Capped at n - 1 so train never loses a category.
    assert Counter(r.category for r in held) == {"math": 3, "coding": 3, "writing": 2, "tiny": 1}
    _, none_held = split_heldout(records, eval_fraction=0.0, seed=0, min_eval_per_category=0)
    assert none_held == []


def test_split_of_one_category_is_independent_of_others() -> None:
    records = _stratified_records()
    extra = [_rec(f"new-{i}", "coding", f"new coding prompt {i}") for i in range(10)]
    _, held = split_heldout(records, eval_fraction=0.1, seed=0)
    _, held_more = split_heldout(records + extra, eval_fraction=0.1, seed=0)
    assert [r.id for r in held if r.category == "math"] == [r.id for r in held_more if r.category == "math"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"eval_fraction": 1.0, "seed": 0}, "eval_fraction"),
        ({"eval_fraction": -0.1, "seed": 0}, "eval_fraction"),
        ({"eval_fraction": 0.1, "seed": 0, "min_eval_per_category": -1}, "min_eval_per_category"),
    ],
)
def test_split_rejects_bad_arguments(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        split_heldout(_stratified_records(), **kwargs)  # type: ignore[arg-type]


def test_split_rejects_duplicate_ids() -> None:
    records = [_rec("same", "x", "a"), _rec("same", "x", "b")]
    with pytest.raises(ValueError, match="unique"):
        split_heldout(records, eval_fraction=0.5, seed=0)


def test_split_works_on_synthetic_pool(big_pool: list[PromptRecord]) -> None:
    train, held = split_heldout(big_pool, eval_fraction=0.05, seed=1)
    assert Counter(r.category for r in held) == dict.fromkeys(CATEGORIES, 17)
    assert len(train) + len(held) == len(big_pool)
