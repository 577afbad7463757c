"""What went wrong with a torchrun launch's ranks, and which rank caused it.

torchrun reports every rank that failed, and the ones it stopped because one failed look just as failed. This
module names the cause: the earliest `@record` error file, else a rank killed by a signal torchrun did not
send (the OOM killer, an operator's `kill -9`), else the root cause torchrun's summary names. A rank that
stops (SIGSTOP, a wedged host) fails nothing and would leave its peers waiting in a collective: every rank
beats a heartbeat (`start_heartbeat`), and `wait_watching` raises `Stalled` once a live rank has been silent
past its bound.
"""

import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

from draftsmith.core.proctree import process_alive

HEARTBEAT_ENV = "DRAFTSMITH_HEARTBEAT_DIR"
HEARTBEAT_S = 1.0  # a rank touches its heartbeat file this often; the launcher looks twice as often
_SUMMARY_RANK = re.compile(r"^\s*rank\s*:\s*(\d+) \(local_rank: (\d+)\)")
_SUMMARY_ERROR_FILE = re.compile(r"^\s*error_file:\s*(\S+)")
_SUMMARY_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+) \(pid: (\d+)\)")
# torchrun's own shutdown of the ranks still running once one failed: those signals are consequences.
_CLOSING = re.compile(r"Sending process (\d+) closing signal")
# torchrun's prefix, and torch's own logging may add the same once more: "[rank1]:[rank1]: Traceback ...".
_RANK_PREFIX = re.compile(r"^((?:\[rank\d+\]:)*)(.*)$")
_CHAINED = ("During handling of the above exception", "The above exception was the direct cause")
_STATES = {"T": "stopped", "t": "stopped by a tracer", "D": "in uninterruptible sleep", "R": "running"}


class TorchrunError(RuntimeError):
    """torchrun exited non-zero: `rank` is the first failing global rank (None if unknown), `traceback` its
    Python traceback (or the tail of the launch output when the rank left none, e.g. killed by a signal)."""

    def __init__(self, message: str, *, rank: int | None, traceback: str) -> None:
        self.rank = rank
        self.traceback = traceback.rstrip()
        super().__init__(f"{message}\n{self.traceback}".rstrip())


class TorchrunTimeout(TorchrunError, TimeoutError):
    """The launch outlived `timeout_s`; torchrun and every rank were killed."""


def _error_files(log_dir: Path, since_ns: int) -> list[Path]:
    """`<log_dir>/<run>/attempt_<n>/<local_rank>/error.json` written by this launch, oldest first."""
    files = [p for p in log_dir.glob("*/attempt_*/*/error.json") if p.stat().st_mtime_ns >= since_ns]
    # Seconds-resolution timestamps inside the files tie; the file written first is the root cause
    # (the other ranks fail because it went away).
    return sorted(files, key=lambda p: p.stat().st_mtime_ns)


def _summary_ranks(lines: list[str]) -> tuple[dict[str, int], int | None, dict[int, tuple[int, int]]]:
    """From torchrun's failure summary: error file -> global rank, the root-cause rank, and for each rank that
    died of a signal and left no error file, (signal number, pid)."""
    by_file, root, current, in_root, exits, signalled = {}, None, None, False, {}, {}
    for line in lines:
        in_root = in_root or line.startswith("Root Cause")
        if m := _SUMMARY_RANK.match(line):
            current = int(m.group(1))
            if in_root and root is None:
                root = current
        elif (m := _SUMMARY_EXIT.match(line)) and current is not None:
            exits[current] = (int(m.group(1)), int(m.group(2)))
        elif (m := _SUMMARY_ERROR_FILE.match(line)) and current is not None:
            by_file[m.group(1)] = current
            if exits.get(current, (0,))[0] < 0 and m.group(1) == "<N/A>":
                signalled[current] = (-exits[current][0], exits[current][1])
    return by_file, root, signalled


def _killed_from_outside(lines: list[str], signalled: dict[int, tuple[int, int]]) -> tuple[int, int, int] | None:
    """(rank, signal, pid) of a rank that died of a signal torchrun did not send: the cause, not a consequence.

    Once a rank fails, torchrun sends the others a closing signal (and SIGKILL after its grace period); their
    deaths follow from the failure. A rank that died of a signal before that, without a Python error, was
    killed from outside or crashed, and its peers' broken collectives only follow from it.
    """
    closed = {int(m.group(1)) for line in lines if (m := _CLOSING.search(line))}
    outside = [(rank, sig, pid) for rank, (sig, pid) in sorted(signalled.items()) if pid not in closed]
    return outside[0] if outside else None


def _read_error_file(path: Path) -> tuple[str, str]:
    """(message, traceback) from an elastic `error.json` as `@record` writes it."""
    data = json.loads(path.read_text())
    message = data.get("message", "")
    if isinstance(message, dict):
        extra = message.get("extraInfo") or {}
        return str(message.get("message", "")), str(extra.get("py_callstack", ""))
    return str(message), str(message)


def _signal_name(sig: int) -> str:
    try:
        return f"{signal.Signals(sig).name} (signal {sig})"
    except ValueError:
        return f"signal {sig}"


def failure(module: str, log_dir: str | None, nnodes: int, rc: int, lines: list[str], since_ns: int) -> TorchrunError:
    """The error for a launch of `module` that exited `rc`: the rank that caused it, from what torchrun printed
    (`lines`) and the `@record` error files written under `log_dir` since `since_ns`."""
    by_file, root_rank, signalled = _summary_ranks(lines)
    if killed := _killed_from_outside(lines, signalled):
        rank, sig, pid = killed
        return TorchrunError(
            f"torchrun {module}: rank {rank} (pid {pid}) was killed by {_signal_name(sig)}, not by torchrun, "
            "and left no Python error; the other ranks failed or were stopped because it went. Last output:",
            rank=rank,
            traceback="\n".join(lines[-30:]),
        )
    files = _error_files(Path(log_dir), since_ns) if log_dir else []
    if files:
        first = files[0]
        local_rank = int(first.parent.name)
        file_rank = by_file.get(str(first), local_rank if nnodes == 1 else None)
        message, traceback = _read_error_file(first)
        where = f"rank {file_rank}" if file_rank is not None else f"local rank {local_rank}"
        return TorchrunError(f"torchrun {module}: {where} failed: {message}", rank=file_rank, traceback=traceback)
    tail = "\n".join(lines[-60:])
    who = f"rank {root_rank}" if root_rank is not None else "a rank or torchrun itself"
    return TorchrunError(
        f"torchrun {module}: exited {rc}; {who} failed without an error file (no @record, or killed by a "
        "signal); last output:",
        rank=root_rank,
        traceback=tail,
    )


def start_heartbeat(stall_s: float, bound: str) -> None:
    """In a rank: tell the launcher this process still runs, so that one stopped for `stall_s` is named and killed.

    `bound` names the setting `stall_s` comes from, for the error. Writes `rank-<RANK>.json` (rank, pid, the
    bound) into `$DRAFTSMITH_HEARTBEAT_DIR` and touches it every `HEARTBEAT_S` from a daemon thread, which
    keeps beating while the rank waits in a collective or computes (both release the GIL) and stops when
    the process is stopped or wedged. A no-op outside `run_torchrun`.
    """
    folder = os.environ.get(HEARTBEAT_ENV)
    if not folder:
        return
    rank = int(os.environ.get("RANK", "0"))
    path = Path(folder, f"rank-{rank}.json")
    record = {"rank": rank, "pid": os.getpid(), "stall_s": stall_s, "bound": bound}
    path.with_suffix(".tmp").write_text(json.dumps(record))
    path.with_suffix(".tmp").replace(path)  # the launcher never reads half a record

    def beat() -> None:
        while True:
            time.sleep(HEARTBEAT_S)
            try:
                os.utime(path)
            except OSError:
                return  # the launch is over and its folder gone

    threading.Thread(target=beat, name="rank-heartbeat", daemon=True).start()


class Stalled(Exception):
    """`.args[0]`: this node's ranks alive but silent past their bound, as (heartbeat record, seconds, state)."""


def _process_state(pid: int) -> str:
    try:
        code = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"
    return _STATES.get(code, "sleeping")


def check_heartbeats(folder: Path) -> None:
    """Raise `_Stalled` for the ranks whose heartbeat is older than their bound while their process lives."""
    stalled = []
    for path in folder.glob("rank-*.json"):
        try:
            beat, age = json.loads(path.read_text()), time.time() - path.stat().st_mtime
        except (OSError, ValueError):
            continue
        # A rank that exited is torchrun's to report; only a live, silent one is stalled.
        if age > beat["stall_s"] and process_alive(beat["pid"]):
            stalled.append((beat, age, _process_state(beat["pid"])))
    if stalled:
        raise Stalled(sorted(stalled, key=lambda s: s[0]["rank"]))


def wait_watching(proc: subprocess.Popen, timeout_s: float | None, heartbeats: Path) -> int:
    """torchrun's exit code; `Stalled` as soon as a rank stalls, `TimeoutExpired` after `timeout_s`."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        step = HEARTBEAT_S / 2 if deadline is None else max(0.0, min(HEARTBEAT_S / 2, deadline - time.monotonic()))
        try:
            return proc.wait(timeout=step)
        except subprocess.TimeoutExpired:
            if deadline is not None and time.monotonic() >= deadline:
                raise
        check_heartbeats(heartbeats)


def stall_error(module: str, stalled: Stalled, tail: list[str]) -> TorchrunError:
    who = "; ".join(
        f"rank {beat['rank']} (pid {beat['pid']}, {state}) sent no heartbeat for {age:.1f} s, over "
        f"{beat['bound']} = {beat['stall_s']:g} s"
        for beat, age, state in stalled.args[0]
    )
    return TorchrunError(
        f"torchrun {module}: {who}; the job cannot finish without it, so it, torchrun and every other rank "
        "were killed. Last output:",
        rank=stalled.args[0][0][0]["rank"],
        traceback="\n".join(tail[-20:]),
    )


class TracebackLines:
    """Tells the lines of Python tracebacks in a launch's interleaved output, per rank prefix.

    A traceback runs from `Traceback (most recent call last):` through its frames, indented deeper than that
    line (and chained tracebacks), to the next line at its indentation, the exception itself, which belongs
    to it too. torchrun's failure summary quotes the root cause's traceback indented after `traceback :`.
    """

    def __init__(self) -> None:
        self._open: dict[str, int] = {}  # rank prefix -> indentation of its open traceback

    def within(self, line: str) -> bool:
        m = _RANK_PREFIX.match(line)
        prefix, text = (m.group(1) or "", m.group(2)) if m else ("", line)
        indent = len(text) - len(text.lstrip())
        if "Traceback (most recent call last):" in text:
            self._open[prefix] = indent
            return True
        if prefix not in self._open:
            return False
        base = self._open[prefix]
        if not text.strip() or indent > base or text[indent:].startswith(_CHAINED):
            return True
        del self._open[prefix]
        return indent == base  # the exception line ends it; a line less indented is not part of it
