"""This machine's processes as `/proc` shows them: a process's `stat` fields, whether it is alive, its descendants.

One reader for every caller that stops a process tree (torchrun's ranks, vLLM's engine processes), meters its
CPU time or checks that nothing was left behind. Linux only: elsewhere `processes()` is empty, `stat_fields`
is None and callers fall back to signals.
"""

from pathlib import Path

PROC = Path("/proc")


def _fields(stat: str) -> list[str]:
    # The command name may hold spaces or parentheses: the fields after the last ')' are fixed.
    return stat.rsplit(")", 1)[1].split()


def stat_fields(pid: int) -> list[str] | None:
    """`/proc/<pid>/stat` after the command name: `[state, ppid, pgrp, session, ...]`; None once it is gone."""
    try:
        return _fields((PROC / str(pid) / "stat").read_text())
    except (OSError, IndexError):
        return None


def process_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (orphans reparented to a non-reaping init stay zombies)."""
    fields = stat_fields(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def processes() -> dict[int, list[str]]:
    """Every process readable now: pid -> its `stat` fields (see `stat_fields`). Empty without `/proc`."""
    out: dict[int, list[str]] = {}
    if not PROC.is_dir():
        return out
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            out[int(entry.name)] = _fields((entry / "stat").read_text())
        except (OSError, IndexError):  # exited since the listing
            continue
    return out


def children_map(procs: dict[int, list[str]] | None = None) -> dict[int, list[int]]:
    """Parent pid -> its children's pids, from `procs` (default: `processes()` now)."""
    children: dict[int, list[int]] = {}
    for pid, fields in (processes() if procs is None else procs).items():
        children.setdefault(int(fields[1]), []).append(pid)
    return children


def descendants(pid: int, procs: dict[int, list[str]] | None = None) -> list[int]:
    """Every process below `pid`, parents before their children, zombies included (filter with
    `process_alive` where they count as gone)."""
    children, out, todo = children_map(procs), [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.append(child)
                todo.append(child)
    return out
