"""Benchmark file loaders: local paths or `s3://` URLs, JSONL or Parquet, one `BenchPrompt` per row.

Formats, told apart by the first row's keys unless `format=` says which:

- `mtbench`: MT-Bench-style `{"question_id", "category", "turns": [...]}`; only `turns` is required (a
  missing id becomes `{name}-{line}`, a missing category the bench name), an optional `system` is kept.
- `speedbench`: SPEED-Bench rows (nvidia/SPEED-Bench on Hugging Face, configs `qualitative` and
  `throughput_1k` ... `throughput_32k`, split `test`, shipped as Parquet): `question_id`, `category`,
  `turns` (list of strings) are required; `sub_category`, `source`, `src_id`, `difficulty` and `multiturn`
  (any one of them marks the format) are ignored. Multi-turn rows keep every turn.
- `gsm8k`: `{"question", "answer"}`; the question is the prompt, verbatim (category "math").
- `math500`: `{"problem", "solution", ...}`; the problem is the prompt, verbatim; `unique_id` is the id when
  present (category "math").
- `humaneval`: `{"task_id", "prompt", "entry_point", ...}`; the prompt is a code stub (signature and
  docstring), so it is wrapped in an instruction to complete it (`HUMANEVAL_TEMPLATE`, category "coding").
- `mbpp`: original `{"task_id", "text", "test_list", ...}` or sanitized `{"task_id", "prompt", "test_list",
  ...}`; the task text is the prompt, followed by the asserts of `test_list` (as in the MBPP paper: they
  name the function to write), `MBPP_TEMPLATE`, category "coding".

Reference answers, solutions and tests other than MBPP's asserts are ignored: evaluation measures how well
a drafter predicts the target's own answers, not whether they are right. Any unusable row is an error
naming the file, the line (row number for Parquet) and the field.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

from draftsmith.core import storage
from draftsmith.core.rows import BadRow, jsonl_rows, parquet_rows
from draftsmith.evals.records import BenchPrompt

FORMATS: tuple[str, ...] = ("mtbench", "speedbench", "gsm8k", "math500", "humaneval", "mbpp")
HUMANEVAL_TEMPLATE = (
    "Complete the following Python function. Reply with the whole function in one Python code block.\n\n"
    "```python\n{prompt}\n```"
)
MBPP_TEMPLATE = "{text}\n\nYour code should pass these tests:\n\n```python\n{tests}\n```"
_SPEEDBENCH_KEYS = ("sub_category", "multiturn", "src_id", "difficulty")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")


class BenchFileError(ValueError):
    """A benchmark file that cannot be read as prompts; the message names file, line and field."""


def load_bench(name: str, path: str, *, limit: int | None = None, format: str | None = None) -> list[BenchPrompt]:
    """Read one benchmark file into prompts, in file order.

    Args:
        name: Benchmark name (the `NAME` of `--bench NAME=PATH`); default id prefix and mtbench category.
        path: Local path or fsspec URL (`s3://...`) of a JSONL (optionally compressed, by file name) or
            Parquet file (recognised by its `PAR1` magic bytes, whatever the name).
        limit: Keep only the first `limit` rows (later rows are not read).
        format: One of `FORMATS`; detected from the first row's keys when None.

    Returns:
        Prompts with `source=path`.

    Raises:
        FileNotFoundError: `path` does not exist.
        BenchFileError: Unknown format, an unusable row (`path:line: ...` with the field), repeated ids or
            a file without rows.
    """
    if format is not None and format not in FORMATS:
        raise ValueError(f"bench {name!r}: unknown format {format!r}; known: {', '.join(FORMATS)}")
    if limit is not None and limit < 0:
        raise ValueError(f"bench {name!r}: limit must be >= 0, got {limit}")
    if not storage.exists(path):
        raise FileNotFoundError(f"bench {name!r}: {path} does not exist")
    prompts: list[BenchPrompt] = []
    id_lines: dict[str, int] = {}
    fmt = format
    for line, row in _rows(path):
        if limit is not None and len(prompts) >= limit:
            break
        where = f"{path}:{line}"
        if isinstance(row, BadRow):
            raise BenchFileError(f"{where}: {row.detail}")
        if not isinstance(row, dict):
            raise BenchFileError(f"{where}: row must be a JSON object, got {type(row).__name__}")
        fmt = fmt or detect_format(row, where)
        prompt = _PARSERS[fmt](row, name=name, line=line, source=path, where=where)
        if prompt.id in id_lines:
            raise BenchFileError(f"{where}: duplicate id {prompt.id!r} (first on line {id_lines[prompt.id]})")
        id_lines[prompt.id] = line
        prompts.append(prompt)
    if not prompts and limit != 0:
        raise BenchFileError(f"bench {name!r}: {path} holds no rows")
    return prompts


def parse_bench_arg(arg: str) -> tuple[str, str]:
    """Split the CLI's `--bench NAME=PATH` into `(name, path)`.

    Raises:
        ValueError: No `=`, an empty side, or a name that is not letters, digits, `_`, `.` or `-`.
    """
    name, sep, path = arg.partition("=")
    name, path = name.strip(), path.strip()
    usage = "--bench expects NAME=PATH, e.g. gsm8k=s3://bucket/gsm8k.jsonl"
    if not sep:
        raise ValueError(f"{usage}; got {arg!r} (no '=')")
    if not name or not path:
        raise ValueError(f"{usage}; got {arg!r} (empty {'NAME' if not name else 'PATH'})")
    if not _NAME.fullmatch(name):
        raise ValueError(f"{usage}; NAME {name!r} may hold only letters, digits, '_', '.' and '-' (it names files)")
    return name, path


def detect_format(row: dict[str, Any], where: str) -> str:
    """The format of a row, from its keys (see the module docstring); `where` prefixes the error."""
    keys = set(row)
    if "turns" in keys:
        return "speedbench" if keys & set(_SPEEDBENCH_KEYS) else "mtbench"
    if "task_id" in keys and "test_list" in keys:
        return "mbpp"
    if "task_id" in keys and "prompt" in keys and keys & {"entry_point", "canonical_solution"}:
        return "humaneval"
    if "problem" in keys:
        return "math500"
    if "question" in keys and "answer" in keys:
        return "gsm8k"
    if "question_id" in keys and keys & set(_SPEEDBENCH_KEYS):
        return "speedbench"  # without turns: named as such, so the error names the missing field
    raise BenchFileError(
        f"{where}: cannot tell the benchmark format from keys {sorted(keys)[:10]}; "
        f"pass format= one of {', '.join(FORMATS)}"
    )


# --------------------------------------------------------------------------------------------------
# Reading.


def _rows(path: str) -> Iterator[tuple[int, Any]]:
    fs, inner = storage.filesystem(path)
    with fs.open(inner, "rb") as handle:
        magic = handle.read(4)
    return parquet_rows(path) if magic == b"PAR1" else jsonl_rows(path)


# --------------------------------------------------------------------------------------------------
# Fields.


def _required(row: dict[str, Any], key: str, where: str, fmt: str) -> Any:
    if key not in row or row[key] is None:
        raise BenchFileError(f"{where}: {fmt} row is missing field {key!r} (keys: {sorted(row)[:10]})")
    return row[key]


def _text(row: dict[str, Any], key: str, where: str, fmt: str) -> str:
    value = _required(row, key, where, fmt)
    if not isinstance(value, str) or not value.strip():
        raise BenchFileError(f"{where}: field {key!r} must be a non-empty string, got {value!r:.80}")
    return value


def _ident(value: Any, key: str, where: str) -> str:
    # Benchmarks use both int (MT-Bench, MBPP) and str ids (HumanEval, SPEED-Bench); bools are neither.
    if isinstance(value, bool) or not isinstance(value, int | str) or not str(value).strip():
        raise BenchFileError(f"{where}: field {key!r} must be a non-empty string or integer, got {value!r:.80}")
    return str(value)


def _turns(row: dict[str, Any], where: str, fmt: str) -> list[str]:
    value = _required(row, "turns", where, fmt)
    problem = f"{where}: field 'turns' must be a non-empty list of non-empty strings"
    if not isinstance(value, list) or not value:
        raise BenchFileError(f"{problem}, got {value!r:.80}")
    for index, turn in enumerate(value):
        if not isinstance(turn, str) or not turn.strip():
            raise BenchFileError(f"{problem}; item {index} is {turn!r:.80}")
    return list(value)


def _optional_text(row: dict[str, Any], key: str, where: str) -> str | None:
    value = row.get(key)
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if not isinstance(value, str):
        raise BenchFileError(f"{where}: field {key!r} must be a string, got {value!r:.80}")
    return value


# --------------------------------------------------------------------------------------------------
# One parser per format: (row, name, line, source, where) -> BenchPrompt.


def _mtbench(row: dict[str, Any], *, name: str, line: int, source: str, where: str) -> BenchPrompt:
    turns = _turns(row, where, "mtbench")
    qid = row.get("question_id")
    return BenchPrompt(
        id=_ident(qid, "question_id", where) if qid is not None else f"{name}-{line}",
        category=_optional_text(row, "category", where) or name,
        turns=turns,
        system=_optional_text(row, "system", where),
        source=source,
    )


def _speedbench(row: dict[str, Any], *, name: str, line: int, source: str, where: str) -> BenchPrompt:
    return BenchPrompt(
        id=_ident(_required(row, "question_id", where, "speedbench"), "question_id", where),
        category=_text(row, "category", where, "speedbench"),
        turns=_turns(row, where, "speedbench"),
        source=source,
    )


def _gsm8k(row: dict[str, Any], *, name: str, line: int, source: str, where: str) -> BenchPrompt:
    return BenchPrompt(
        id=f"{name}-{line}", category="math", turns=[_text(row, "question", where, "gsm8k")], source=source
    )


def _math500(row: dict[str, Any], *, name: str, line: int, source: str, where: str) -> BenchPrompt:
    uid = row.get("unique_id")
    return BenchPrompt(
        id=_ident(uid, "unique_id", where) if uid is not None else f"{name}-{line}",
        category="math",
        turns=[_text(row, "problem", where, "math500")],
        source=source,
    )


def _humaneval(row: dict[str, Any], *, name: str, line: int, source: str, where: str) -> BenchPrompt:
    stub = _text(row, "prompt", where, "humaneval")
    return BenchPrompt(
        id=_ident(_required(row, "task_id", where, "humaneval"), "task_id", where),
        category="coding",
        turns=[HUMANEVAL_TEMPLATE.format(prompt=stub.strip("\n"))],
        source=source,
    )


def _mbpp(row: dict[str, Any], *, name: str, line: int, source: str, where: str) -> BenchPrompt:
    # The original release calls the task "text", the sanitized one "prompt".
    if "text" not in row and "prompt" not in row:
        raise BenchFileError(f"{where}: mbpp row is missing field 'text' (original) or 'prompt' (sanitized)")
    text = _text(row, "text" if "text" in row else "prompt", where, "mbpp")
    tests = _required(row, "test_list", where, "mbpp")
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) and t.strip() for t in tests):
        raise BenchFileError(f"{where}: field 'test_list' must be a non-empty list of strings, got {tests!r:.80}")
    return BenchPrompt(
        id=_ident(_required(row, "task_id", where, "mbpp"), "task_id", where),
        category="coding",
        turns=[MBPP_TEMPLATE.format(text=text.strip(), tests="\n".join(t.strip() for t in tests))],
        source=source,
    )


_PARSERS: dict[str, Callable[..., BenchPrompt]] = {
    "mtbench": _mtbench,
    "speedbench": _speedbench,
    "gsm8k": _gsm8k,
    "math500": _math500,
    "humaneval": _humaneval,
    "mbpp": _mbpp,
}
