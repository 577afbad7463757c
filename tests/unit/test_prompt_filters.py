"""Unit tests for draftsmith.tasks.prompt_filters: dedupe, length, near duplicates, decontamination, mix and split."""

from __future__ import annotations

from collections import Counter
from fractions import Fraction

import pytest

from draftsmith.core.config.select import SYNTHETIC_CATEGORIES
from draftsmith.tasks import prompt_filters as pf
from draftsmith.tasks.prompt_pool import PromptRecord, synthetic_pool

pytestmark = pytest.mark.unit

LONG = (
    "Explain how a hash table handles collisions when two different keys map to the same bucket, "
    "and compare separate chaining with open addressing in terms of memory use and lookup speed."
)


def _rec(rid: str, text: str, category: str = "c", system: str | None = None) -> PromptRecord:
    return PromptRecord(id=rid, category=category, system=system, turns=[text])


def _distinct(n: int, category: str = "c", prefix: str = "") -> list[PromptRecord]:
    # Numbers spelt as unrelated words keep prompts far apart for MinHash and n-grams alike.
    return [
        _rec(
            f"{prefix}{category}{i}", f"topic {category} item {i} " + " ".join(f"w{i}x{j}" for j in range(6)), category
        )
        for i in range(n)
    ]


def test_the_synthetic_pool_writes_every_category_the_recipe_accepts_and_no_other() -> None:
    # The recipe's `select.mix` is checked against SYNTHETIC_CATEGORIES; the pool must draw exactly those.
    pool = synthetic_pool(10 * len(SYNTHETIC_CATEGORIES), seed=0)
    assert Counter(r.category for r in pool) == {c: 10 for c in SYNTHETIC_CATEGORIES}
    assert {r.category for r in synthetic_pool(12, seed=0, mix={"coding": 1.0})} == {"coding"}


def test_exact_dedupe_ignores_case_and_spacing() -> None:
    kept, dropped = pf.exact_dedupe([_rec("a", "Hello  World"), _rec("b", "hello world"), _rec("c", "hello")])
    assert [r.id for r in kept] == ["a", "c"] and dropped == 1


def test_length_filter_counts_short_and_long() -> None:
    records = [_rec("a", "one"), _rec("b", "one two three"), _rec("c", "one two three four five six")]
    kept, short, long = pf.length_filter(
        records, lambda texts: [len(t.split()) for t in texts], min_tokens=2, max_tokens=4
    )
    assert ([r.id for r in kept], short, long) == (["b"], 1, 1)


def test_tool_definitions_count_towards_length() -> None:
    record = PromptRecord(id="t", category="c", turns=["hi"], tools=[{"name": "lookup"}])
    assert "lookup" in pf.prompt_texts(record)


def test_near_dedupe_removes_one_word_paraphrase_and_keeps_distinct() -> None:
    paraphrase = LONG.replace("different", "distinct")
    other = (
        "Write a short story about a lighthouse keeper who discovers that the ships she guides are "
        "carrying letters addressed to her from a future version of herself."
    )
    records = [_rec("orig", LONG), _rec("para", paraphrase), _rec("other", other), *_distinct(30)]
    kept, dropped = pf.near_dedupe(records, threshold=0.7, num_perm=128, shingle_size=3)
    assert dropped == 1
    assert [r.id for r in kept] == ["orig", "other"] + [f"c{i}" for i in range(30)]


def test_near_dedupe_ignores_shared_system_prompts() -> None:
    system = "You are a careful assistant who answers every question with great care and precision. " * 5
    records = [_rec(f"r{i}", f"question number {i} about subject {i * 7}", system=system) for i in range(5)]
    assert pf.near_dedupe(records, threshold=0.7, num_perm=128, shingle_size=3)[1] == 0


def test_contamination_by_long_ngram_only() -> None:
    index = pf.ngram_index([LONG], 8)
    borrowed = _rec("b", "Please help: " + " ".join(LONG.split()[3:14]) + " thanks")
    assert pf.contaminated(borrowed, index, 8)
    assert not pf.contaminated(_rec("s", "How do hash tables work in Python?"), index, 8)
    # A reference shorter than n words only matches a prompt with exactly its words.
    short = pf.ngram_index(["What is 2 + 2?"], 8)
    assert pf.contaminated(_rec("x", "what is 2+2"), short, 8)
    assert not pf.contaminated(_rec("y", "What is 2 + 3?"), short, 8)


def test_allocate_is_exact_and_proportional() -> None:
    assert pf.allocate(10, {"a": Fraction(1), "b": Fraction(1), "c": Fraction(1)}) == {"a": 4, "b": 3, "c": 3}
    assert sum(pf.allocate(24, {"a": Fraction(2), "b": Fraction(1), "z": Fraction(0)}).values()) == 24
    assert pf.allocate(5, {"a": Fraction(0)}) == {"a": 0}


def _pool() -> list[PromptRecord]:
    return _distinct(40, "math") + _distinct(40, "code") + _distinct(20, "chat")


@pytest.mark.parametrize("num_eval", [1, 7, 24, 29])
def test_choose_holds_out_exactly_num_eval_stratified(num_eval: int) -> None:
    sel = pf.choose(_pool(), num_prompts=60, num_eval=num_eval, mix=None, seed=0, ngram=13)
    assert len(sel.eval) == num_eval and len(sel.train) == 60 - num_eval
    assert not {r.id for r in sel.train} & {r.id for r in sel.eval}
    if num_eval == 24:
        # Quotas 24/24/12 give eval shares 9.6/9.6/4.8: largest remainders go to chat, then code.
        assert Counter(r.category for r in sel.eval) == {"code": 10, "math": 9, "chat": 5}


def test_choose_follows_mix_and_reports_shortfall() -> None:
    sel = pf.choose(
        _pool(), num_prompts=50, num_eval=5, mix={"math": 3, "code": 1, "chat": 1, "poem": 1}, seed=0, ngram=13
    )
    kept = Counter(r.category for r in sel.train + sel.eval)
    # Quotas of 50 by 3:1:1:1 are 25, 8, 9, 8 (the tie for the spare seat goes to the first name).
    assert kept == {"math": 25, "code": 8, "chat": 9}
    assert sel.shortfall == {"poem": 8}
    assert sel.over_quota == 100 - 42


def test_choose_is_deterministic_by_seed() -> None:
    a = pf.choose(_pool(), num_prompts=30, num_eval=6, mix=None, seed=1, ngram=13)
    b = pf.choose(_pool(), num_prompts=30, num_eval=6, mix=None, seed=1, ngram=13)
    c = pf.choose(_pool(), num_prompts=30, num_eval=6, mix=None, seed=2, ngram=13)
    assert (a.train, a.eval) == (b.train, b.eval)
    assert [r.id for r in a.eval] != [r.id for r in c.eval]


def test_choose_replaces_train_prompts_contaminated_by_eval() -> None:
    twins = [_rec(f"t{i}", LONG + f" Variant {i}.", "math") for i in range(10)]
    records = twins + _distinct(30, "math")
    sel = pf.choose(records, num_prompts=20, num_eval=2, mix=None, seed=0, ngram=13)
    assert len(sel.eval) == 2 and len(sel.train) == 18
    eval_index = pf.ngram_index([t for r in sel.eval for t in r.turns], 13)
    assert not any(pf.contaminated(r, eval_index, 13) for r in sel.train)
    assert len(sel.train) + len(sel.eval) + sel.contaminated + sel.over_quota == len(records)


def test_choose_needs_more_than_num_eval() -> None:
    with pytest.raises(ValueError, match=r"select\.num_eval: only 3 prompts are left"):
        pf.choose(_distinct(3), num_prompts=10, num_eval=3, mix=None, seed=0, ngram=13)
