"""Prompt sources: JSONL, Parquet and Hugging Face datasets.

The stage reads leniently (`load_sources`): each row becomes a record or a reject naming its file, line
and reason, so one bad row in a 150K-prompt corpus neither stops the stage nor vanishes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from draftsmith.core import storage
from draftsmith.core.config.select import PromptSource
from draftsmith.core.rejects import Rejects
from draftsmith.core.rows import BadRow, jsonl_rows, parquet_rows
from draftsmith.tasks import prompt_pool
from draftsmith.tasks.prompt_formats import RowError, normalize_row
from draftsmith.tasks.prompt_pool import PromptRecord

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
    write: Callable[[PromptSource, int], Iterator[tuple[int, Any]]] | None = None,
) -> LoadedPrompts:
    """Read and normalise every source; unusable rows go to `rejects` with file, line and reason.

    Args:
        sources: In priority order (earlier rows win exact- and near-duplicate ties).
        synthetic_rows: Pool size of a synthetic source without `max_rows`.
        mix: Category weights; the synthetic pool draws the synthetic categories among them.
        seed: Seed of the synthetic pool.
        rejects: Collector for unusable rows (reasons of `normalize_row`, plus `invalid_utf8`,
            `malformed_json` and `duplicate_id`).
        write: `(source, count) -> rows` of a `target` source (`prompt_writer.written_rows`); required
            when one is listed.
    """
    out = LoadedPrompts()
    seen_ids: dict[str, str] = {}
    for src in sources:
        where = src.path or src.kind
        if src.kind == "synthetic":
            records = prompt_pool.synthetic_pool(src.max_rows or synthetic_rows, seed=seed, mix=_synthetic_mix(mix))
            rows: Iterator[tuple[int, Any]] = ((i, r) for i, r in enumerate(records, start=1))
        elif src.kind == "target":
            if write is None:
                raise ValueError("select.sources: a `target` source needs the target to write its prompts")
            rows = write(src, src.max_rows or synthetic_rows)
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
    if src.kind in ("synthetic", "target"):
        return src.kind  # their content follows from the recipe, the seed (and the target), all in the key
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
