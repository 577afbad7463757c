"""Atomic reads and writes on a local folder or any fsspec URL (s3://, memory://, ...).

Local writes go to a temporary sibling, are fsynced and renamed into place, so a reader sees either the
old file or the whole new one. Object stores (S3) make a PUT visible only once it is complete.

A failed operation raises a `StorageError` whose one-line message names the URL and the operation: a full
disk says so, with the free space left; a store that refuses (permissions, credentials) raises
`StorageRefused`, never retried; a store that does not answer raises `StorageUnavailable`, a
`ConnectionError`, so the stage's retry policy treats it as transient. A missing file still raises
`FileNotFoundError` on reads, which callers test for. Messages carry no credentials.
"""

import errno
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from draftsmith.core.redact import MASK, redact
from draftsmith.core.retry import is_transient

_NO_SPACE = {errno.ENOSPC, errno.EDQUOT}
_BUCKET_STORES = {"s3", "s3a", "gs", "gcs"}
# S3 answers that asking again will not change (botocore raises them untranslated to direct client calls).
_REFUSED_CODES = {
    "AccessDenied",
    "AllAccessDisabled",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
}
# Values that authenticate to an object store: masked even where no pattern would recognise them.
_CREDENTIAL_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


class StorageError(OSError):
    """A run-folder operation failed; the message is one line naming the URL and the operation."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


class StorageRefused(StorageError, PermissionError, ValueError):
    """The store refused the operation (permissions, bucket policy, credentials). Asking again gets the same
    answer, so it is not transient; a ValueError too, so `draftsmith run` exits 2 as for other unusable
    settings."""


class StorageUnavailable(StorageError, ConnectionError):
    """The store did not answer (down, restarting, unreachable); transient, so a stage retry may succeed."""


def _code(err: BaseException) -> str | None:
    """The S3 error code of a botocore ClientError, or of the one s3fs translated into `err`."""
    for e in (err, err.__cause__):
        response = getattr(e, "response", None)
        if isinstance(response, dict) and response.get("Error", {}).get("Code"):
            return str(response["Error"]["Code"])
    return None


def _reason(err: BaseException) -> str:
    """The first line of what went wrong, with the store's error code and without credentials."""
    text = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
    lines = text.strip().splitlines()
    text = lines[0] if lines else type(err).__name__
    code = _code(err)
    if code and code not in text:
        text = f"{code}: {text}"
    for name in _CREDENTIAL_ENV:
        value = os.environ.get(name, "")
        if len(value) >= 4:
            text = text.replace(value, MASK)
    return redact(text).rstrip(".")


def _store(url: str) -> str:
    """Who answered: the bucket of an object-store URL, else the filesystem or the fsspec store."""
    protocol, sep, rest = url.partition("://")
    if not sep or protocol in ("file", "local"):
        return "the filesystem"
    if protocol in _BUCKET_STORES:
        return f"bucket {rest.split('/', 1)[0]!r}"
    return f"the {protocol} store"


def _free_space(url: str) -> str:
    folder = Path(url.removeprefix("file://")).parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return f"{shutil.disk_usage(folder).free} bytes free in {folder}"
    except OSError:
        return f"free space in {folder} unknown"


def _named(err: Exception, op: str, url: str) -> StorageError | None:
    """`err` as a StorageError that names `url` and `op`; None to let it through as it is."""
    if isinstance(err, StorageError | FileNotFoundError):
        return None
    reason = _reason(err)
    store = _store(url)
    # A read-only filesystem (a mount, a snapshot) refuses as a permission does: asking again changes nothing.
    if isinstance(err, PermissionError) or _code(err) in _REFUSED_CODES or getattr(err, "errno", None) == errno.EROFS:
        hint = "; check the credentials in use and the bucket policy" if store.startswith("bucket") else ""
        return StorageRefused(errno.EACCES, f"{url}: {op} refused by {store}: {reason}{hint}")
    if isinstance(err, OSError) and err.errno in _NO_SPACE:
        return StorageError(err.errno, f"{url}: {op} failed: no space left on device ({_free_space(url)})")
    if is_transient(err):
        return StorageUnavailable(errno.EIO, f"{url}: {op} failed, {store} did not answer: {reason}")
    if isinstance(err, OSError):
        return StorageError(err.errno or errno.EIO, f"{url}: {op} failed: {reason}")
    return None


@contextmanager
def reported(op: str, url: str) -> Iterator[None]:
    """Re-raise a failure of the block as a `StorageError` naming `url` and `op` (a missing file and errors
    that are not about storage pass unchanged). For code that talks to a store directly, as this module does."""
    try:
        yield
    except Exception as err:
        named = _named(err, op, url)
        if named is None:
            raise
        raise named from err


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
    with reported("check", url):
        return fs.exists(path)


def size(url: str) -> int:
    fs, path = filesystem(url)
    with reported("stat", url):
        return int(fs.size(path))


def makedirs(url: str) -> None:
    fs, path = filesystem(url)
    with reported("create folder", url):
        fs.makedirs(path, exist_ok=True)


def remove_tree(url: str) -> None:
    fs, path = filesystem(url)
    with reported("delete", url):
        if not fs.exists(path):
            return
        fs.rm(path, recursive=True)
        if isinstance(fs, LocalFileSystem):
            return
        # s3fs drops the per-key errors of a bulk delete: a refused key is simply still there. Deleting it
        # alone raises the store's own answer, so stale files never survive a "removed" folder unnoticed.
        fs.invalidate_cache(path)
        for left in fs.find(path):
            with reported("delete", fs.unstrip_protocol(left)):
                fs.rm_file(left)


def list_names(url: str) -> list[str]:
    """Base names directly under `url` (empty when it does not exist)."""
    fs, path = filesystem(url)
    with reported("list", url):
        if not fs.exists(path):
            return []
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False))


def write_bytes(url: str, data: bytes) -> None:
    """Write `data` to `url` atomically; on failure nothing new is left there, not even a temp file."""
    fs, path = filesystem(url)
    with reported("write", url):
        if isinstance(fs, LocalFileSystem):
            _write_local(Path(path), data)
        else:
            fs.pipe_file(path, data)


def _write_local(target: Path, data: bytes) -> None:
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


def read_bytes(url: str) -> bytes:
    fs, path = filesystem(url)
    with reported("read", url):
        return fs.cat_file(path)


def read_ranges(url: str, ranges: list[tuple[int, int]]) -> list[bytes]:
    """Byte ranges `[start, end)` of one object; fsspec fetches them concurrently on object stores."""
    if not ranges:
        return []
    fs, path = filesystem(url)
    starts, ends = [r[0] for r in ranges], [r[1] for r in ranges]
    with reported("read", url):
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
