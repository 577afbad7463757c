"""Atomic reads and writes on a local folder or any fsspec URL (s3://, memory://, ...).

Local writes go to a temporary sibling, are fsynced and renamed into place, so a reader sees either the
old file or the whole new one. Object stores (S3) make a PUT visible only once it is complete.
"""

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem


def join(base: str, *parts: str) -> str:
    """Join URL or path segments with '/'."""
    out = base.rstrip("/")
    for part in parts:
        out += "/" + part.strip("/")
    return out


def filesystem(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem for `url` and the path inside it."""
    return fsspec.core.url_to_fs(url)


def is_local(url: str) -> bool:
    return isinstance(filesystem(url)[0], LocalFileSystem)


def exists(url: str) -> bool:
    fs, path = filesystem(url)
    return fs.exists(path)


def size(url: str) -> int:
    fs, path = filesystem(url)
    return int(fs.size(path))


def makedirs(url: str) -> None:
    fs, path = filesystem(url)
    fs.makedirs(path, exist_ok=True)


def remove_tree(url: str) -> None:
    fs, path = filesystem(url)
    if fs.exists(path):
        fs.rm(path, recursive=True)


def list_names(url: str) -> list[str]:
    """Base names directly under `url` (empty when it does not exist)."""
    fs, path = filesystem(url)
    if not fs.exists(path):
        return []
    return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False))


def write_bytes(url: str, data: bytes) -> None:
    """Write `data` to `url` atomically."""
    fs, path = filesystem(url)
    if isinstance(fs, LocalFileSystem):
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    else:
        fs.pipe_file(path, data)


def read_bytes(url: str) -> bytes:
    fs, path = filesystem(url)
    return fs.cat_file(path)


def read_ranges(url: str, ranges: list[tuple[int, int]]) -> list[bytes]:
    """Byte ranges `[start, end)` of one object; fsspec fetches them concurrently on object stores."""
    if not ranges:
        return []
    fs, path = filesystem(url)
    starts, ends = [r[0] for r in ranges], [r[1] for r in ranges]
    return fs.cat_ranges([path] * len(ranges), starts, ends)


def write_json(url: str, obj: Any) -> None:
    write_bytes(url, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def read_json(url: str) -> Any:
    return json.loads(read_bytes(url))


def write_jsonl(url: str, rows: list[dict[str, Any]]) -> None:
    write_bytes(url, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode())


def read_jsonl(url: str) -> list[dict[str, Any]]:
    text = read_bytes(url).decode("utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def local_path(url: str) -> Path:
    """The local path of a local URL; remote URLs are an error (callers stage those through bytes)."""
    fs, path = filesystem(url)
    if not isinstance(fs, LocalFileSystem):
        raise ValueError(f"{url}: a local path is required here")
    return Path(path)
