"""Built-in eval suites (deterministic, disjoint from training prompts) and benchmark file loaders."""

import gzip
import json
from pathlib import Path

import pytest

from draftsmith.core.config.loader import load_recipe
from draftsmith.core.prompt_keys import dedupe_key
from draftsmith.core.rejects import Rejects
from draftsmith.evals import suites
from draftsmith.evals.loaders import (
    HUMANEVAL_TEMPLATE,
    BenchFileError,
    detect_format,
    load_bench,
    parse_bench_arg,
)
from draftsmith.evals.records import BenchPrompt
from draftsmith.tasks import prompt_code, prompt_material, prompt_pool, prompt_pool_reuse
from draftsmith.tasks.prompt_pool import CATEGORIES, synthetic_pool
from draftsmith.tasks.prompt_sources import load_sources

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "deployments" / "recipes").glob("smollm2-cpu-*.yaml"))


def _keys(items) -> set[str]:
    return {dedupe_key(p.system, p.turns) for p in items}


def _write_jsonl(path: Path, rows: list) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


# --------------------------------------------------------------------------------------------------
# Built-in suites.


def test_builtin_suites_shape_and_determinism():
    a = suites.builtin_suites(12, seed=3)
    assert list(a) == list(CATEGORIES)
    for category, items in a.items():
        assert len(items) == 12
        assert all(isinstance(p, BenchPrompt) and p.category == category and p.source == "builtin" for p in items)
        assert len({p.id for p in items}) == 12 and len(_keys(items)) == 12
        # Dialogue items are the multi-turn ones: exactly two turns; the other suites are single-turn.
        assert {len(p.turns) for p in items} == ({2} if category in ("dialogue", "followup") else {1})
    assert a == suites.builtin_suites(12, seed=3)
    other = suites.builtin_suites(12, seed=4)
    assert all(_keys(a[c]) != _keys(other[c]) for c in CATEGORIES)
    # A longer suite extends a shorter one, so growing n never changes the items already measured.
    longer = suites.builtin_suites(20, seed=3)
    assert all(longer[c][:12] == a[c] for c in CATEGORIES)
    assert suites.builtin_suites(0, seed=3) == {c: [] for c in CATEGORIES}
    with pytest.raises(ValueError, match="n_per_suite"):
        suites.builtin_suites(-1, seed=0)


def test_eval_only_vocabulary_is_absent_from_the_training_generator():
    # Synthetic training prompts are built only from the pool modules' strings and digits; an item holding a
    # term that module never contains cannot equal any training prompt, at any seed or pool size.
    source = "\n".join(
        Path(str(m.__file__)).read_text(encoding="utf-8").casefold()
        for m in (prompt_pool, prompt_pool_reuse, prompt_material, prompt_code)
    )
    assert [t for t in suites.EVAL_ONLY_TERMS if t.casefold() in source] == []
    for items in suites.builtin_suites(60, seed=0).values():
        for item in items:
            text = "\n".join(item.turns)
            assert any(term in text for term in suites.EVAL_ONLY_TERMS), item


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_no_overlap_with_the_smollm2_recipe_training_prompts(recipe):
    cfg = load_recipe(recipe)
    # Exactly the pool the select stage reads (it draws train and eval from these records).
    loaded = load_sources(
        cfg.select.resolved_sources(),
        synthetic_rows=2 * cfg.select.num_prompts,
        mix=cfg.select.mix,
        seed=cfg.seed,
        rejects=Rejects("select_prompts"),
    )
    assert len(loaded.records) >= cfg.select.num_prompts
    train = _keys(loaded.records)
    for seed in (0, cfg.seed, 1):
        for items in suites.builtin_suites(50, seed=seed).values():
            assert not _keys(items) & train
            # Near-copies too: no built-in first turn equals any training turn.
            assert not {" ".join(p.turns[0].split()).casefold() for p in items} & {
                " ".join(t.split()).casefold() for r in loaded.records for t in r.turns
            }


def test_no_overlap_with_a_large_synthetic_pool():
    pool = _keys(synthetic_pool(4000, seed=7))
    assert all(not _keys(items) & pool for items in suites.builtin_suites(100, seed=7).values())


# --------------------------------------------------------------------------------------------------
# Loaders, one fixture per format.


def test_mtbench_jsonl(tmp_path):
    path = _write_jsonl(
        tmp_path / "mt.jsonl",
        [
            {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Now shorten it."]},
            "",
            {"turns": ["Only a turn."], "system": "Be brief."},
        ],
    )
    got = load_bench("mt", path)
    assert got == [
        BenchPrompt(id="81", category="writing", turns=["Write a poem.", "Now shorten it."], source=path),
        BenchPrompt(id="mt-3", category="mt", turns=["Only a turn."], system="Be brief.", source=path),
    ]


def test_speedbench_parquet_and_jsonl(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {
            "question_id": "qual-coding-0",
            "category": "coding",
            "sub_category": "python",
            "turns": ["Write a parser.", "Add error handling."],
            "source": "x",
            "src_id": "1",
            "difficulty": "medium",
            "multiturn": True,
        },
        {
            "question_id": "qual-math-1",
            "category": "math",
            "sub_category": "algebra",
            "turns": ["Solve x^2 = 4."],
            "source": "y",
            "src_id": "2",
            "difficulty": "easy",
            "multiturn": False,
        },
    ]
    # A parquet file is recognised by its magic bytes, not its name.
    parquet = tmp_path / "throughput_1k.bin"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    jsonl = _write_jsonl(tmp_path / "qualitative.jsonl", rows)
    for path in (str(parquet), jsonl):
        got = load_bench("speed", path)
        assert [(p.id, p.category, p.turns, p.source) for p in got] == [
            ("qual-coding-0", "coding", ["Write a parser.", "Add error handling."], path),
            ("qual-math-1", "math", ["Solve x^2 = 4."], path),
        ]
    assert detect_format(rows[0], "here") == "speedbench"
    assert load_bench("speed", str(parquet), limit=1)[0].id == "qual-coding-0"


def test_gsm8k_and_math500(tmp_path):
    gsm = tmp_path / "gsm8k.jsonl.gz"
    gsm.write_bytes(gzip.compress(b'{"question": "Tom has 3 apples...", "answer": "3\\n#### 3"}\n'))
    assert load_bench("gsm8k", str(gsm)) == [
        BenchPrompt(id="gsm8k-1", category="math", turns=["Tom has 3 apples..."], source=str(gsm))
    ]
    math = _write_jsonl(
        tmp_path / "math500.jsonl",
        [
            {"problem": "Compute $1+1$.", "solution": "2", "answer": "2", "unique_id": "test/algebra/1.json"},
            {"problem": "Compute $2+2$.", "solution": "4", "answer": "4"},
        ],
    )
    got = load_bench("math500", math)
    assert [(p.id, p.category, p.turns) for p in got] == [
        ("test/algebra/1.json", "math", ["Compute $1+1$."]),
        ("math500-2", "math", ["Compute $2+2$."]),
    ]


def test_humaneval_wraps_the_stub_in_an_instruction(tmp_path):
    stub = 'def add(a, b):\n    """Add two numbers."""\n'
    row = {"task_id": "HumanEval/0", "prompt": stub, "canonical_solution": "    return a + b\n", "entry_point": "add"}
    (got,) = load_bench("humaneval", _write_jsonl(tmp_path / "he.jsonl", [row]))
    assert got.id == "HumanEval/0" and got.category == "coding"
    assert got.turns == [HUMANEVAL_TEMPLATE.format(prompt=stub.rstrip("\n"))]
    assert got.turns[0].startswith("Complete the following Python function.")
    assert "```python\ndef add(a, b):\n" in got.turns[0] and got.turns[0].endswith('"""Add two numbers."""\n```')


def test_mbpp_original_and_sanitized(tmp_path):
    tests = ["assert f(1) == 2", "assert f(2) == 3"]
    original = {"task_id": 11, "text": "Write a function f that adds one.", "code": "...", "test_list": tests}
    sanitized = {"source_file": "x", "task_id": 12, "prompt": "Write a function g.", "code": "...", "test_list": tests}
    got = load_bench("mbpp", _write_jsonl(tmp_path / "mbpp.jsonl", [original, sanitized]))
    assert [p.id for p in got] == ["11", "12"]
    assert got[0].turns == [
        "Write a function f that adds one.\n\nYour code should pass these tests:\n\n"
        "```python\nassert f(1) == 2\nassert f(2) == 3\n```"
    ]
    assert got[1].turns[0].startswith("Write a function g.\n\nYour code should pass these tests:")
    assert {p.category for p in got} == {"coding"}


def test_format_override_when_keys_are_ambiguous(tmp_path):
    # A HumanEval-like row without entry_point/canonical_solution cannot be told from other formats.
    path = _write_jsonl(tmp_path / "code.jsonl", [{"task_id": "T/1", "prompt": "def f():\n"}])
    with pytest.raises(BenchFileError, match=r"code\.jsonl:1: cannot tell the benchmark format.*format="):
        load_bench("code", path)
    assert load_bench("code", path, format="humaneval")[0].id == "T/1"
    # Forcing a format validates every row against it, naming the missing field.
    with pytest.raises(BenchFileError, match=r"code\.jsonl:1: gsm8k row is missing field 'question'"):
        load_bench("code", path, format="gsm8k")
    with pytest.raises(ValueError, match="unknown format 'csv'"):
        load_bench("code", path, format="csv")


# --------------------------------------------------------------------------------------------------
# Bad input.


def test_bad_line_names_file_line_and_field(tmp_path):
    path = _write_jsonl(
        tmp_path / "gsm.jsonl",
        [{"question": "Q1?", "answer": "1"}, {"question": "Q2?", "answer": "2"}, {"answer": "3"}],
    )
    with pytest.raises(BenchFileError, match=r"gsm\.jsonl:3: gsm8k row is missing field 'question'"):
        load_bench("gsm", path)
    # The limit stops before the bad line: later rows are never read.
    assert [p.turns[0] for p in load_bench("gsm", path, limit=2)] == ["Q1?", "Q2?"]


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"turns": ["a"]}, '{"turns": ["b"]'], r"x\.jsonl:2: invalid JSON"),
        ([{"turns": ["a"]}, [1, 2]], r"x\.jsonl:2: row must be a JSON object, got list"),
        ([{"turns": ["a"]}, {"turns": []}], r"x\.jsonl:2: field 'turns' must be a non-empty list"),
        ([{"turns": ["a", " "]}], r"x\.jsonl:1: field 'turns'.*item 1"),
        ([{"question_id": 1, "turns": ["a"]}, {"question_id": "1", "turns": ["b"]}], r"x\.jsonl:2: duplicate id '1'"),
        (
            [{"question_id": "q", "category": "c", "multiturn": False}],
            r"x\.jsonl:1: speedbench row is missing field 'turns'",
        ),
        ([{"task_id": 1, "test_list": ["assert 1"]}], r"x\.jsonl:1: mbpp row is missing field 'text' .* or 'prompt'"),
        ([{"question_id": True, "turns": ["a"]}], r"x\.jsonl:1: field 'question_id' must be a non-empty string or int"),
        ([{"id": 1, "content": "hi"}], r"x\.jsonl:1: cannot tell the benchmark format from keys \['content', 'id'\]"),
        ([], r"holds no rows"),
    ],
)
def test_bad_rows(tmp_path, rows, message):
    path = _write_jsonl(tmp_path / "x.jsonl", rows)
    with pytest.raises(BenchFileError, match=message):
        load_bench("x", path)


def test_bad_utf8_and_missing_file(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"turns": ["ok"]}\n{"turns": ["\xff"]}\n')
    with pytest.raises(BenchFileError, match=r"bad\.jsonl:2: invalid UTF-8"):
        load_bench("bad", str(bad))
    with pytest.raises(FileNotFoundError, match=r"bench 'gone'.*nope\.jsonl does not exist"):
        load_bench("gone", str(tmp_path / "nope.jsonl"))
    with pytest.raises(ValueError, match="limit must be >= 0"):
        load_bench("bad", str(bad), limit=-1)


def test_parse_bench_arg():
    assert parse_bench_arg("gsm8k=s3://bucket/gsm8k.jsonl") == ("gsm8k", "s3://bucket/gsm8k.jsonl")
    assert parse_bench_arg("mt_bench.v1=/data/a=b.jsonl") == ("mt_bench.v1", "/data/a=b.jsonl")
    for arg, why in [
        ("gsm8k.jsonl", "no '='"),
        ("=x.jsonl", "empty NAME"),
        ("gsm8k=", "empty PATH"),
        ("s3://b/x=y", "NAME 's3://b/x' may hold only"),
        ("my bench=x", "NAME 'my bench' may hold only"),
    ]:
        with pytest.raises(ValueError, match=rf"--bench expects NAME=PATH.*{why}"):
            parse_bench_arg(arg)
