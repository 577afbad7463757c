"""Lenient row readers: every line of a JSONL file, or row of a Parquet file, comes back as a row or as a
`BadRow` saying why it could not be read, never as an exception that loses the rest of the file."""

import codecs
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import fsspec


@dataclass
class BadRow:
    """A row that failed before normalisation (bytes or JSON)."""

    reason: str
    detail: str
    raw: Any


def jsonl_rows(path: str) -> Iterator[tuple[int, Any]]:
    """`(line, row)` per non-blank line; undecodable lines come as `BadRow` (`invalid_utf8`, `malformed_json`).

    Lines are read as bytes and decoded one by one, so one bad byte costs one row, not the file.
    Compression (.gz, .zst, ...) follows the file name. A UTF-8 byte-order mark opening the file (as editors
    on Windows write it) is dropped: left on, it would make the first row invalid JSON.
    """
    with fsspec.open(path, "rb", compression="infer") as handle:
        for line_no, raw in enumerate(handle, start=1):
            if line_no == 1:
                raw = raw.removeprefix(codecs.BOM_UTF8)
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield line_no, BadRow("invalid_utf8", f"invalid UTF-8 at byte {exc.start}: {exc.reason}", repr(raw))
                continue
            yield line_no, _parse_json(text)


# A `\uD800`-`\uDFFF` escape; json.loads turns an unpaired one into a lone surrogate, which no UTF-8 file or
# tokenizer accepts: such a row would pass here and fail a whole later step (the token count, train.jsonl).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _parse_json(text: str) -> Any:
    try:
        row = json.loads(text)
    except json.JSONDecodeError as exc:
        return BadRow("malformed_json", f"invalid JSON: {exc.msg} at column {exc.colno}", text)
    except RecursionError:
        return BadRow("malformed_json", "invalid JSON: nested too deeply", text)
    except ValueError as exc:  # an integer of more digits than Python converts
        return BadRow("malformed_json", f"invalid JSON: {str(exc).split(';')[0]}", text)
    if _SURROGATE_ESCAPE.search(text) and _lone_surrogate(row):
        return BadRow("invalid_utf8", "a \\u escape encodes a lone UTF-16 surrogate, which is not text", text)
    return row


def _lone_surrogate(row: Any) -> bool:
    try:
        json.dumps(row, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    except (ValueError, RecursionError):
        return False  # not a text problem; normalisation rejects the row for what it is
    return False


def parquet_rows(path: str) -> Iterator[tuple[int, Any]]:
    """`(row number from 1, row dict)` of a Parquet file, read in record batches."""
    import pyarrow.parquet as pq

    with fsspec.open(path, "rb") as handle:
        row_no = 0
        for batch in pq.ParquetFile(handle).iter_batches(batch_size=4096):
            for row in batch.to_pylist():
                row_no += 1
                yield row_no, row
