"""Unit tests for prompt normalisation (`tasks.prompt_formats`) and lenient sources (`tasks.prompt_sources`)."""

from __future__ import annotations

import codecs
import json
from pathlib import Path

import pytest

from draftsmith.core.config.select import PromptSource, SelectConfig
from draftsmith.core.rejects import Rejects
from draftsmith.tasks.prompt_formats import RowError, normalize_row, reference_texts
from draftsmith.tasks.prompt_pool import PromptRecord
from draftsmith.tasks.prompt_sources import load_sources, path_fingerprint, source_fingerprint

pytestmark = pytest.mark.unit

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def _norm(row: object) -> PromptRecord:
    return normalize_row(row, default_id="d-1", default_category="file")


def _load(*sources: PromptSource, rejects: Rejects | None = None):
    return load_sources(list(sources), synthetic_rows=10, mix=None, seed=0, rejects=rejects or Rejects("t"))


# ---------------------------------------------------------------------------------------- normalise


def test_sharegpt_drops_assistant_turns_and_keeps_system_and_tools() -> None:
    row = {
        "id": "sg1",
        "tools": json.dumps([TOOL]),
        "conversations": [
            {"from": "system", "value": "You are terse."},
            {"from": "human", "value": "Weather in Oslo?"},
            {"from": "gpt", "value": "Calling the tool."},
            {"from": "tool", "value": '{"temp": 3}'},
            {"from": "human", "value": "And in Rome?"},
            {"from": "gpt", "value": "Sunny."},
        ],
    }
    assert _norm(row) == PromptRecord(
        id="sg1", category="file", system="You are terse.", turns=["Weather in Oslo?", "And in Rome?"], tools=[TOOL]
    )


def test_openai_messages_with_content_parts_and_tool_calls() -> None:
    row = {
        "category": "agent",
        "tools": [TOOL],
        "messages": [
            {"role": "developer", "content": "Use tools."},
            {"role": "user", "content": [{"type": "text", "text": "Part one."}, {"type": "text", "text": "Two."}]},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]},
            {"role": "tool", "content": "result"},
            {"role": "user", "content": "Thanks, summarise."},
        ],
    }
    record = _norm(row)
    assert (record.id, record.category, record.system) == ("d-1", "agent", "Use tools.")
    assert record.turns == ["Part one.\nTwo.", "Thanks, summarise."]
    assert record.tools == [TOOL]


def test_prompt_and_turns_with_row_system_and_integer_id() -> None:
    assert _norm({"id": 7, "prompt": "Hi", "system": "Be kind."}) == PromptRecord(
        id="7", category="file", system="Be kind.", turns=["Hi"]
    )
    assert _norm({"turns": ["a", "b"]}).turns == ["a", "b"]


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        (["not", "a", "dict"], "malformed_row"),
        ({"text": "no known shape"}, "unknown_format"),
        ({"prompt": "a", "turns": ["b"]}, "ambiguous_format"),
        ({"messages": [{"content": "hi"}]}, "missing_role"),
        ({"conversations": [{"value": "hi"}]}, "missing_role"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "unknown_role"),
        ({"messages": [{"role": "user", "content": 42}]}, "non_string_content"),
        ({"conversations": [{"from": "human", "value": ["x"]}]}, "non_string_content"),
        ({"prompt": 3}, "non_string_content"),
        ({"messages": [{"role": "user", "content": "  "}]}, "empty_turn"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]}, "empty_turn"),
        ({"conversations": [{"from": "gpt", "value": "answer only"}]}, "no_user_turn"),
        ({"messages": [{"role": "system", "content": "s"}]}, "no_user_turn"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "system", "content": "s"}]}, "system_after_user"),
        (
            {"system": "a", "messages": [{"role": "system", "content": "b"}, {"role": "user", "content": "q"}]},
            "conflicting_system",
        ),
        ({"prompt": "q", "tools": "not json"}, "invalid_tools"),
        ({"prompt": "q", "tools": [{"type": "function"}]}, "invalid_tools"),
        ({"prompt": "q", "category": ""}, "invalid_field"),
    ],
)
def test_unusable_rows_raise_with_reason(row: object, reason: str) -> None:
    with pytest.raises(RowError) as excinfo:
        _norm(row)
    assert excinfo.value.reason == reason


def test_reference_texts_accepts_benchmark_fields_and_prompt_shapes() -> None:
    assert reference_texts({"question": "How many apples?", "answer": "4"}) == ["How many apples?"]
    assert reference_texts({"turns": ["t1", "t2"]}) == ["t1", "t2"]
    with pytest.raises(RowError):
        reference_texts({"answer": "4"})


# ------------------------------------------------------------------------------------------ sources


def _write_lines(path: Path, lines: list[bytes]) -> str:
    path.write_bytes(b"\n".join(lines) + b"\n")
    return str(path)


def test_jsonl_rejects_every_bad_line_with_file_line_and_reason(tmp_path: Path) -> None:
    good = json.dumps({"prompt": "fine"}).encode()
    lines = [
        good,
        b'{"prompt": "broken"',
        b'{"prompt": "caf\xe9"}',
        b"",
        json.dumps({"messages": [{"content": "x"}]}).encode(),
        json.dumps({"id": "jsonl-1", "prompt": "dup id of the first row"}).encode(),
        json.dumps({"conversations": [{"from": "human", "value": "ok"}]}).encode(),
    ]
    path = _write_lines(tmp_path / "p.jsonl", lines)
    rejects = Rejects("t")
    loaded = _load(PromptSource(kind="jsonl", path=path, id_prefix="jsonl"), rejects=rejects)
    assert [r.id for r in loaded.records] == ["jsonl-1", "jsonl-7"]
    assert loaded.read == 6  # the blank line is not a row
    got = [(row["source"], row["line"], row["reason"]) for row in rejects.rows]
    assert got == [
        (path, 2, "malformed_json"),
        (path, 3, "invalid_utf8"),
        (path, 5, "missing_role"),
        (path, 6, "duplicate_id"),
    ]
    assert "\\xe9" in rejects.rows[1]["excerpt"]


@pytest.mark.parametrize("name", ["p.jsonl", "p.jsonl.gz"])
def test_a_byte_order_mark_opening_the_file_does_not_cost_its_first_row(tmp_path: Path, name: str) -> None:
    import gzip

    text = "".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(3))
    data = codecs.BOM_UTF8 + text.encode()
    (tmp_path / name).write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    rejects = Rejects("t")
    loaded = _load(PromptSource(kind="jsonl", path=str(tmp_path / name), id_prefix="b"), rejects=rejects)
    assert rejects.rows == []
    assert [(r.id, r.turns) for r in loaded.records] == [(f"b-{i + 1}", [f"question {i}"]) for i in range(3)]


def test_parquet_source_and_max_rows(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {
            "id": f"r{i}",
            "messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": "a"}],
        }
        for i in range(5)
    ]
    path = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    loaded = _load(PromptSource(kind="parquet", path=str(path), max_rows=3, category="chat"))
    assert [(r.id, r.category, r.turns) for r in loaded.records] == [
        (f"r{i}", "chat", [f"question {i}"]) for i in range(3)
    ]
    assert loaded.read == 3


def test_hf_load_from_disk_source_picks_the_split(tmp_path: Path) -> None:
    import datasets

    train = datasets.Dataset.from_list([{"prompt": "first"}, {"prompt": "second"}])
    test = datasets.Dataset.from_list([{"prompt": "other split"}])
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(tmp_path / "ds"))
    loaded = _load(PromptSource(kind="hf_disk", path=str(tmp_path / "ds"), split="train"))
    assert [(r.id, r.turns) for r in loaded.records] == [("ds-1", ["first"]), ("ds-2", ["second"])]
    with pytest.raises(ValueError, match=r"no split 'validation'"):
        _load(PromptSource(kind="hf_disk", path=str(tmp_path / "ds"), split="validation"))


def test_several_sources_keep_order_and_synthetic_size(tmp_path: Path) -> None:
    path = _write_lines(tmp_path / "a.jsonl", [json.dumps({"prompt": "from file"}).encode()])
    loaded = _load(PromptSource(kind="jsonl", path=path), PromptSource(kind="synthetic", max_rows=4))
    assert loaded.records[0].id == "a.jsonl-1"
    assert len(loaded.records) == 5 and loaded.read_by_source == {path: 1, "synthetic": 4}


def test_fingerprint_follows_content(tmp_path: Path) -> None:
    path = _write_lines(tmp_path / "a.jsonl", [b'{"prompt": "x"}'])
    before = path_fingerprint(path)
    assert before == source_fingerprint(PromptSource(kind="jsonl", path=path))
    _write_lines(tmp_path / "a.jsonl", [b'{"prompt": "y"}'])
    assert path_fingerprint(path) != before
    with pytest.raises(FileNotFoundError, match="does not exist"):
        path_fingerprint(str(tmp_path / "missing.jsonl"))


# ------------------------------------------------------------------------------------------- config


def test_legacy_shorthand_resolves_to_one_source() -> None:
    assert SelectConfig(num_prompts=4, num_eval=1).resolved_sources() == [PromptSource(kind="synthetic")]
    cfg = SelectConfig(source="jsonl", path="x.jsonl", num_prompts=4, num_eval=1)
    assert cfg.resolved_sources() == [PromptSource(kind="jsonl", path="x.jsonl")]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sources": [{"kind": "jsonl"}]}, "select.sources[0].path: required for kind 'jsonl'"),
        ({"sources": [{"kind": "synthetic", "path": "x"}]}, "select.sources[0].path: a synthetic source takes no path"),
        ({"sources": [{"kind": "synthetic"}], "path": "x.jsonl"}, "select.sources: give either"),
        (
            {"sources": [{"kind": "jsonl", "path": "a/p.jsonl"}, {"kind": "jsonl", "path": "b/p.jsonl"}]},
            "select.sources[1].id_prefix: 'p.jsonl' is also",
        ),
        ({"mix": {"math": -1.0}}, "select.mix.math: weight must be"),
        ({"mix": {"poetry": 1.0}}, "select.mix: unknown category 'poetry'"),
        ({"min_prompt_tokens": 10, "max_prompt_tokens": 5}, "select.max_prompt_tokens: 5 is below"),
    ],
)
def test_config_errors_name_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        SelectConfig(num_prompts=4, num_eval=1, **kwargs)
