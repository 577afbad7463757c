"""Prompt sources and selection operations: JSONL input, deduplication, the held-out split.

Rows are validated one by one, and a bad row names its file and line, so a 150K-prompt corpus fails
at the row that is wrong rather than somewhere downstream.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterable
from typing import Any

import fsspec
from pydantic import ValidationError

from tasks.prompt_pool import PromptRecord, dedupe_key


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
    with fsspec.open(path, "rt", encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            record = _parse_line(line, where, default_id=f"{base}-{line_no}")
            if record.id in id_lines:
                raise ValueError(f"{where}: duplicate id {record.id!r} (first on line {id_lines[record.id]})")
            id_lines[record.id] = line_no
            records.append(record)
    return records


def _parse_line(line: str, where: str, *, default_id: str) -> PromptRecord:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: invalid JSON: {exc.msg} at column {exc.colno}") from None
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
        raise ValueError(f"{where}: {exc}") from None


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
