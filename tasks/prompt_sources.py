"""Prompt sources: JSONL, Parquet and Hugging Face datasets, plus the strict JSONL reader and old helpers.

The stage reads leniently (`load_sources`): each row becomes a record or a reject naming its file, line
and reason, so one bad row in a 150K-prompt corpus neither stops the stage nor vanishes. The strict
`read_prompts_jsonl` raises at the first bad row, for callers that want that.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from draftsmith.core import storage
from draftsmith.core.config.select import PromptSource
from draftsmith.core.prompt_keys import dedupe_key
from draftsmith.core.rejects import Rejects
from draftsmith.core.rows import BadRow, jsonl_rows, parquet_rows
from draftsmith.tasks import prompt_pool
from draftsmith.tasks.prompt_formats import RowError, normalize_row
from draftsmith.tasks.prompt_pool import PromptRecord


def read_prompts_jsonl(path: str) -> list[PromptRecord]:
    """Reads prompts from a JSONL file (local path or an fsspec URL such as ``s3://``).

    Each non-blank line is an object with optional ``id``, ``category`` and ``system`` and exactly one of
    ``turns`` (list of strings), ``prompt`` (string) or ``messages`` (chat messages; assistant messages
    are dropped since the target regenerates them). Other keys are ignored.

    Args:
        path: File path or fsspec URL.

    Returns:
        Records in file order; a missing id becomes ``{basename}-{line_no}``, a missing category "file".

    Raises:
        ValueError: Prefixed with ``path:line`` for invalid JSON, a malformed row or a repeated id.
    """
    base = os.path.basename(path.rstrip("/"))
    records: list[PromptRecord] = []
    id_lines: dict[str, int] = {}
    for line_no, row in jsonl_rows(path):
        where = f"{path}:{line_no}"
        record = _parse_row(row, where, default_id=f"{base}-{line_no}")
        if record.id in id_lines:
            raise ValueError(f"{where}: duplicate id {_shown(record.id)} (first on line {id_lines[record.id]})")
        id_lines[record.id] = line_no
        records.append(record)
    return records


def _parse_row(row: Any, where: str, *, default_id: str) -> PromptRecord:
    if isinstance(row, BadRow):
        raise ValueError(f"{where}: {row.detail}")
    if not isinstance(row, dict):
        raise ValueError(f"{where}: row must be a JSON object, got {type(row).__name__}")
    try:
        system, turns = _conversation(row)
        record_id = _optional_str(row, "id") or default_id
        category = _optional_str(row, "category") or "file"
        return PromptRecord(id=record_id, category=category, system=system, turns=turns)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ValueError(f"{where}: field {'.'.join(map(str, first['loc']))!r}: {first['msg']}") from None
    except ValueError as exc:
        raise ValueError(f"{where}: {_short(str(exc))}") from None
    except RecursionError:  # repr() of a field nested too deeply
        raise ValueError(f"{where}: the row's fields are nested too deeply") from None


def _optional_str(row: dict[str, Any], key: str) -> str | None:
    value = row.get(key)
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise ValueError(f"field {key!r} must be a non-empty string, got {value!r}")
    return value


def _conversation(row: dict[str, Any]) -> tuple[str | None, list[str]]:
    shapes = [key for key in ("turns", "prompt", "messages") if key in row]
    if len(shapes) != 1:
        found = f" (found {', '.join(shapes)})" if shapes else ""
        raise ValueError(f"row must have exactly one of 'turns', 'prompt' or 'messages'{found}")
    system = row.get("system")
    if system is not None and not isinstance(system, str):
        raise ValueError(f"field 'system' must be a string, got {system!r}")
    if shapes == ["turns"]:
        return system, _turns(row["turns"])
    if shapes == ["prompt"]:
        prompt = row["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"field 'prompt' must be a non-empty string, got {prompt!r}")
        return system, [prompt]
    message_system, turns = _messages(row["messages"])
    if system and message_system:
        raise ValueError("both field 'system' and a system message are given; keep one")
    return system or message_system, turns


def _turns(value: Any) -> list[str]:
    problem = "field 'turns' must be a non-empty list of strings"
    if not isinstance(value, list) or not value:
        raise ValueError(f"{problem}, got {value!r}")
    for index, turn in enumerate(value):
        if not isinstance(turn, str) or not turn.strip():
            raise ValueError(f"{problem}; item {index} is {turn!r}")
    return value


def _messages(value: Any) -> tuple[str | None, list[str]]:
    if not isinstance(value, list) or not value:
        raise ValueError("field 'messages' must be a non-empty list of {'role', 'content'} objects")
    systems: list[str] = []
    turns: list[str] = []
    for index, message in enumerate(value):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("system", "user", "assistant"):
            raise ValueError(f"messages[{index}] needs role 'system', 'user' or 'assistant', got {role!r}")
        content = message.get("content")
        if role == "assistant":
            continue
        if not isinstance(content, str) or (role == "user" and not content.strip()):
            raise ValueError(f"messages[{index}].content must be a non-empty string, got {content!r}")
        if role == "user":
            turns.append(content)
        elif turns:
            # A mid-conversation system message cannot be expressed as one leading system prompt.
            raise ValueError(f"messages[{index}]: system message after a user message is not supported")
        else:
            systems.append(content)
    if not turns:
        raise ValueError("field 'messages' has no user message")
    return "\n\n".join(s for s in systems if s.strip()) or None, turns


# --------------------------------------------------------------------------------------------------
# Cleaning and splitting.


def dedupe(records: Iterable[PromptRecord]) -> tuple[list[PromptRecord], int]:
    """Removes exact duplicates by normalized text (system + turns, whitespace-collapsed, casefolded).

    Args:
        records: Records in priority order; the first of each duplicate group is kept.

    Returns:
        The kept records in their original order and the number dropped.
    """
    seen: set[str] = set()
    kept: list[PromptRecord] = []
    dropped = 0
    for record in records:
        key = dedupe_key(record.system, record.turns)
        if key in seen:
            dropped += 1
        else:
            seen.add(key)
            kept.append(record)
    return kept, dropped


def split_heldout(
    records: Iterable[PromptRecord], *, eval_fraction: float, seed: int, min_eval_per_category: int = 1
) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """Splits records into train and eval, stratified by category.

    A category of n >= 2 records sends ``max(min_eval_per_category, round(eval_fraction * n))`` records to
    eval, capped at n - 1 so train keeps every such category; a lone record goes to eval only if
    ``round(eval_fraction)`` is 1. Each category is sampled with its own seeded RNG, so adding records to
    one category does not reshuffle the others.

    Args:
        records: Records with unique ids.
        eval_fraction: Fraction of each category to hold out, in [0, 1).
        seed: Seed for the per-category selection.
        min_eval_per_category: Floor on eval records per category with at least two records.

    Returns:
        ``(train, eval)``, each in input order, with disjoint ids.

    Raises:
        ValueError: On an out-of-range fraction, a negative minimum or repeated ids.
    """
    if not 0 <= eval_fraction < 1:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    if min_eval_per_category < 0:
        raise ValueError(f"min_eval_per_category must be >= 0, got {min_eval_per_category}")
    records = list(records)
    if len({r.id for r in records}) != len(records):
        raise ValueError("record ids must be unique to split them disjointly; run dedupe or fix the ids")
    by_category: dict[str, list[int]] = {}
    for index, record in enumerate(records):
        by_category.setdefault(record.category, []).append(index)
    held: set[int] = set()
    for category, indices in by_category.items():
        k = round(eval_fraction * len(indices))
        if len(indices) >= 2:
            k = min(max(k, min_eval_per_category), len(indices) - 1)
        # A str seed is hashed stably (unlike hash()), so the split survives interpreter restarts.
        held.update(random.Random(f"{seed}:{category}").sample(indices, k))
    train = [record for index, record in enumerate(records) if index not in held]
    return train, [records[index] for index in sorted(held)]


# --------------------------------------------------------------------------------------------------
# Lenient sources for the selection stage: every row read becomes a record or a reject, never a crash.


@dataclass
class LoadedPrompts:
    """Records of all sources in source order, and how many rows each source yielded (rejects included)."""

    records: list[PromptRecord] = field(default_factory=list)
    read_by_source: dict[str, int] = field(default_factory=dict)

    @property
    def read(self) -> int:
        return sum(self.read_by_source.values())


def load_sources(
    sources: list[PromptSource],
    *,
    synthetic_rows: int,
    mix: dict[str, float] | None,
    seed: int,
    rejects: Rejects,
) -> LoadedPrompts:
    """Read and normalise every source; unusable rows go to `rejects` with file, line and reason.

    Args:
        sources: In priority order (earlier rows win exact- and near-duplicate ties).
        synthetic_rows: Pool size of a synthetic source without `max_rows`.
        mix: Category weights; the synthetic pool draws the synthetic categories among them.
        seed: Seed of the synthetic pool.
        rejects: Collector for unusable rows (reasons of `normalize_row`, plus `invalid_utf8`,
            `malformed_json` and `duplicate_id`).
    """
    out = LoadedPrompts()
    seen_ids: dict[str, str] = {}
    for src in sources:
        where = src.path or "synthetic"
        if src.kind == "synthetic":
            records = prompt_pool.synthetic_pool(src.max_rows or synthetic_rows, seed=seed, mix=_synthetic_mix(mix))
            rows: Iterator[tuple[int, Any]] = ((i, r) for i, r in enumerate(records, start=1))
        else:
            rows = _rows(src)
        read = 0
        for line, row in rows:
            if src.max_rows is not None and read >= src.max_rows:
                break
            read += 1
            record = row if isinstance(row, PromptRecord) else _record(row, src, line, where, rejects)
            if record is None:
                continue
            if record.id in seen_ids:
                rejects.add(
                    source=where,
                    line=line,
                    row_id=record.id,
                    reason="duplicate_id",
                    detail=f"id {_shown(record.id)} already used ({seen_ids[record.id]})",
                )
                continue
            seen_ids[record.id] = f"{where}:{line}"
            out.records.append(record)
        out.read_by_source[where] = out.read_by_source.get(where, 0) + read
    return out


def _synthetic_mix(mix: dict[str, float] | None) -> dict[str, float] | None:
    if mix is None:
        return None
    own = {c: w for c, w in mix.items() if c in prompt_pool.CATEGORIES}
    # No synthetic category weighted: draw evenly, and let the selection's quotas discard them.
    return own if any(w > 0 for w in own.values()) else None


_DETAIL_CHARS = 300  # a reason is one short line; the row itself is in the excerpt


def _record(row: Any, src: PromptSource, line: int, where: str, rejects: Rejects) -> PromptRecord | None:
    if isinstance(row, BadRow):
        rejects.add(source=where, line=line, reason=row.reason, detail=row.detail, raw=row.raw)
        return None
    try:
        return normalize_row(row, default_id=f"{src.label()}-{line}", default_category=src.category)
    except RowError as exc:
        reason, detail = exc.reason, exc.detail
    except RecursionError:  # a field nested too deeply for the reasons' repr()
        reason, detail = "malformed_row", "the row's fields are nested too deeply"
    row_id = row.get("id") if isinstance(row, dict) and isinstance(row.get("id"), str) else None
    rejects.add(source=where, line=line, row_id=row_id, reason=reason, detail=_short(detail), raw=_excerpt(row))
    return None


def _short(detail: str) -> str:
    return detail if len(detail) <= _DETAIL_CHARS else f"{detail[: _DETAIL_CHARS - 3]}..."


def _shown(value: str) -> str:
    """`repr(value)`, cut to about 60 characters: a long id must not crowd out the rest of a reason."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _excerpt(row: Any) -> Any:
    if not isinstance(row, dict | list):
        return row
    try:
        return json.dumps(row, ensure_ascii=False, default=str)
    except (ValueError, RecursionError):
        return "(the row is nested too deeply to show)"


def _rows(src: PromptSource) -> Iterator[tuple[int, Any]]:
    assert src.path is not None  # enforced by SelectConfig
    if src.kind == "jsonl":
        return jsonl_rows(src.path)
    if src.kind == "parquet":
        return parquet_rows(src.path)
    return hf_rows(src)


def hf_rows(src: PromptSource) -> Iterator[tuple[int, Any]]:
    """Rows of a Hugging Face dataset: by name (`load_dataset`) or from a `save_to_disk` folder."""
    import datasets

    assert src.path is not None
    if src.kind == "hf":
        data = datasets.load_dataset(src.path, src.subset, split=src.split, revision=src.revision)
    else:
        data = datasets.load_from_disk(src.path)
        if isinstance(data, datasets.DatasetDict):
            if src.split not in data:
                raise ValueError(f"select.sources: {src.path}: no split {src.split!r}; it has {sorted(data)}")
            data = data[src.split]
    if src.max_rows is not None:
        data = data.select(range(min(src.max_rows, len(data))))
    yield from enumerate(data, start=1)


def source_fingerprint(src: PromptSource) -> str:
    """What identifies a source's content for the stage key (hub datasets: name, split and revision)."""
    if src.kind == "synthetic":
        return "synthetic"
    assert src.path is not None
    if src.kind == "hf":
        return f"hf:{src.path}:{src.subset}:{src.split}:{src.revision}"
    return path_fingerprint(src.path)


def path_fingerprint(url: str) -> str:
    """sha256 of a local file's (or folder's) bytes; an object store's ETag/size/mtime for remote URLs."""
    fs, path = storage.filesystem(url)
    if not fs.exists(path):
        raise FileNotFoundError(f"{url}: file or folder does not exist")
    files = sorted(fs.find(path)) if fs.isdir(path) else [path]
    h = hashlib.sha256()
    for name in files:
        h.update(f"\0{name[len(path) :]}\0".encode())
        if storage.is_local(url):
            with fs.open(name, "rb") as handle:
                while chunk := handle.read(1 << 20):
                    h.update(chunk)
        else:
            info = fs.info(name)
            keep = ("ETag", "etag", "size", "LastModified", "mtime", "VersionId", "md5Hash", "generation")
            h.update(json.dumps({k: str(info[k]) for k in keep if k in info}, sort_keys=True).encode())
    return h.hexdigest()
