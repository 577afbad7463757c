"""One writer per run folder: `hold(run_dir)` for the life of a pipeline run.

A local run folder is locked with `flock` on `<run>/.lock`. The lock belongs to an open file, so the kernel
drops it when every process holding that file is gone: a killed run leaves no lock behind, only its holder
record (host, pid, start time, command) in the file, which the next run overwrites (saying it took over). A
run that ends, well or with an error, empties the record, so the next one starts without that message. The
trainer's torchrun inherits the open file (`inherited_fds`), so a rerun is refused while an old trainer is
still writing. A folder the lock file cannot be created in (read-only) is refused with one line
(`StorageRefused`, exit 2) before anything else of the run starts.

An object-store run folder is held by a lease object renewed with conditional puts (`draftsmith.core.runlease`):
a killed run stops renewing it, and the next run takes it over once it has expired (`storage.lock_lease_s`).
"""

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import socket
import sys
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from draftsmith.core.runlease import RunFolderBusy, S3Lease

log = logging.getLogger("draftsmith.core.runlock")

LOCK_NAME = ".lock"
# tempfile.mkstemp(prefix=".<name>.", suffix=".tmp") as draftsmith.core.storage's atomic writes name them.
_TEMP = re.compile(r"^\..+\.[A-Za-z0-9_]{8}\.tmp$")


class _Held:
    def __init__(self, path: Path, fd: int) -> None:
        self.path, self.fd, self.depth = path, fd, 1
        self.lease: Any = None  # an object-store folder's S3Lease (fd is then -1)


# Keyed by the lock file's resolved path: a nested hold in this process (a subflow on the same folder) must
# not flock the file a second time, which would conflict with our own first open file.
_held: dict[Path | str, _Held] = {}
_guard = threading.Lock()


def _command() -> str:
    from draftsmith.core.redact import redact  # a --set value may carry a secret

    cmd = " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv and sys.argv[0] else sys.executable
    flow_run = os.environ.get("PREFECT__FLOW_RUN_ID")
    return redact(cmd + (f" (flow run {flow_run})" if flow_run else ""))[:500]


def read_holder(path: Path) -> dict | None:
    """The holder record in a lock file, or None when it is missing or half-written."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _pid_alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _open_lock_file(folder: Path) -> tuple[Path, int | None]:
    """The lock file's path and, unless this process holds it already, a new open file of it. A folder that
    cannot hold it (read-only, not ours) raises `StorageRefused` naming the lock file."""
    from draftsmith.core import storage

    with storage.reported("write", str(folder / LOCK_NAME)):
        folder.mkdir(parents=True, exist_ok=True)
        path = (folder / LOCK_NAME).resolve()
        if path in _held:
            return path, None
        return path, os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)


def _acquire_local(run_dir: str, folder: Path) -> _Held:
    with _guard:
        path, fd = _open_lock_file(folder)
        if fd is None:
            held = _held[path]
            held.depth += 1
            return held
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise RunFolderBusy(run_dir, read_holder(path)) from None
        old = read_holder(path)
        if old and old.get("pid") != os.getpid():
            # The lock was free, so whatever this record names is gone (or no longer holds the folder).
            state = "no longer running" if not _pid_alive(old.get("pid")) else "no longer holding it"
            log.info(
                "run folder %s: taking over from pid %s on %s (%s)", run_dir, old.get("pid"), old.get("host"), state
            )
        record = _record()
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode() + b"\n", 0)
        held = _held[path] = _Held(path, fd)
        return held


def _release_local(held: _Held) -> None:
    with _guard:
        held.depth -= 1
        if held.depth > 0:
            return
        _held.pop(held.path, None)
        os.close(held.fd)
        _clear_record(held.path)


def _clear_record(path: Path) -> None:
    """Empty the holder record of a lock this process just let go of, so the next run finds no one to take
    over from. Only when the lock is free: a child that inherited the file (a trainer still writing) keeps it
    held, and then the record, which names this process, stays to say who started it."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return  # removed with its folder, or no longer ours to write
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if (read_holder(path) or {}).get("pid") == os.getpid():  # not a record another run wrote meanwhile
            os.ftruncate(fd, 0)
    except OSError:
        pass  # held by a child or by the next run: its record is the right one
    finally:
        os.close(fd)  # drops the flock taken here


def _record() -> dict:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": _command(),
    }


@contextlib.contextmanager
def _hold_remote(run_dir: str, lease_s: float | None) -> Iterator[None]:
    from draftsmith.core.config import StorageConfig

    with _guard:
        if (held := _held.get(run_dir)) is not None:  # a nested hold in this process
            held.depth += 1
        else:
            lease = S3Lease(run_dir, _record(), lease_s or StorageConfig().lock_lease_s)
            lease.acquire()
            held = _held[run_dir] = _Held(Path(run_dir), -1)
            held.lease = lease
    try:
        yield
    finally:
        with _guard:
            held.depth -= 1
            last = held.depth == 0
            if last:
                _held.pop(run_dir, None)
        if last:
            held.lease.release()
            if held.lease.lost:
                raise RuntimeError(f"run folder {run_dir}: {held.lease.lost}; its results may mix two runs' writes")


@contextlib.contextmanager
def hold(run_dir: str, lease_s: float | None = None) -> Iterator[None]:
    """Hold `run_dir` for the block, or raise RunFolderBusy naming the process that holds it.

    `lease_s` is the lease of an object-store folder (None: `StorageConfig`'s); a local folder is flocked.
    """
    from draftsmith.core import storage

    if not storage.is_local(run_dir):
        with _hold_remote(run_dir, lease_s):
            yield
        return
    held = _acquire_local(run_dir, storage.local_path(run_dir))
    try:
        yield
    finally:
        _release_local(held)


def inherited_fds() -> tuple[int, ...]:
    """Open lock files a child that writes into a run folder should inherit (`Popen(pass_fds=...)`).

    While such a child lives the lock stays held, even after this process is killed.
    """
    with _guard:
        return tuple(h.fd for h in _held.values() if h.fd >= 0)


def remove_stale_temps(folder: str) -> list[str]:
    """Delete atomic-write temp files (`.<name>.XXXXXXXX.tmp`) left anywhere under a local `folder` by a
    writer that was killed mid-write; returns their paths relative to `folder`. Only safe for the folder's
    one writer."""
    from draftsmith.core import storage

    if not storage.is_local(folder):
        return []  # object-store writes are single PUTs: no temp files
    path = storage.local_path(folder)
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for entry in path.rglob("*.tmp"):
            if _TEMP.match(entry.name) and entry.is_file():
                entry.unlink(missing_ok=True)
                removed.append(str(entry.relative_to(path)))
    if removed:
        log.info("%s: removed %d temp files of an interrupted write: %s", folder, len(removed), ", ".join(removed))
    return sorted(removed)
