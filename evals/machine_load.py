"""How busy the machine was while a timing ran: the load average, and the CPU that other processes used.

A speed-up measured while other jobs share the cores is not the idle machine's: speculation's extra sequential
work (drafting, then verifying) suffers more from contention than plain decoding, so a loaded machine can turn
a gain into a loss. The 1-minute load average counts every runnable thread, the measured servers' own
included (a vLLM CPU server keeps one thread per core busy while it decodes), so it cannot tell a loaded
machine from a busy server. `LoadMeter` therefore also measures the CPU time that processes outside this
process tree used over the span, from `/proc`: on an idle machine that is close to 0 cores whatever the
servers do. On a virtual machine the host can also take the cores away (steal time, `/proc/stat`): no
process here shows it, yet the servers run slower, so it is reported apart from the other processes' share.

Linux only (`/proc`); elsewhere the meter reports the load average alone.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from draftsmith.core import proctree

_PROC = proctree.PROC


@dataclass(frozen=True)
class Load:
    """The machine during one span."""

    seconds: float
    load_avg_1m: float  # mean of the 1-minute load average sampled over the span
    other_cores: float | None  # CPU time of processes outside this tree per second of the span; None: no /proc
    cores: int
    steal_cores: float | None = None  # cores' worth of time the host ran other guests (steal); None: no /proc

    @property
    def busy(self) -> bool:
        """Other processes and the host together took more than a quarter of the cores: the timing is not an
        idle machine's."""
        taken = (self.other_cores or 0.0) + (self.steal_cores or 0.0)
        return taken > 0.25 * self.cores

    def to_dict(self) -> dict:
        return {
            "seconds": round(self.seconds, 2),
            "load_avg_1m": round(self.load_avg_1m, 2),
            "other_cores": None if self.other_cores is None else round(self.other_cores, 3),
            "steal_cores": None if self.steal_cores is None else round(self.steal_cores, 3),
            "cores": self.cores,
            "busy": self.busy,
        }


def _cpu_ticks() -> tuple[int, int] | None:
    """All CPUs' time since boot spent running this machine's work, and stolen by the host, in clock ticks
    (`/proc/stat`)."""
    try:
        fields = (_PROC / "stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
    return user + nice + system + irq + softirq, steal


def _tree_ticks(root: int) -> int:
    """CPU time of `root` and every live descendant, with their reaped children's (`/proc/<pid>/stat`)."""
    procs = proctree.processes()
    ours = [root, *proctree.descendants(root, procs)]
    # utime stime cutime cstime: the stat fields 14-17, here 11-14 after the command name
    return sum(sum(int(v) for v in procs[pid][11:15]) for pid in ours if pid in procs)


class LoadMeter:
    """Measure spans: `start()`, `sample()` as often as convenient (it reads the load average), `stop()`.

    A process of this tree that exits during a span takes its CPU time with it, which then counts as other
    processes'; the measured servers and the load generator live for the whole measurement, so that is only
    ever a short-lived helper's fraction of a second.
    """

    def __init__(self, root: int | None = None) -> None:
        self._root = root if root is not None else os.getpid()
        self._start: tuple[float, tuple[int, int] | None, int] | None = None
        self._samples: list[float] = []

    def start(self) -> None:
        self._samples = [os.getloadavg()[0]]
        ticks = _cpu_ticks()
        self._start = (time.monotonic(), ticks, _tree_ticks(self._root) if ticks is not None else 0)

    def sample(self) -> None:
        self._samples.append(os.getloadavg()[0])

    def stop(self) -> Load:
        if self._start is None:
            raise RuntimeError("LoadMeter.stop() before start()")
        t0, ticks0, ours0 = self._start
        self.sample()
        seconds = max(time.monotonic() - t0, 1e-9)
        ticks1 = _cpu_ticks()
        other = steal = None
        if ticks0 is not None and ticks1 is not None:
            per_s = os.sysconf("SC_CLK_TCK") * seconds
            other = max(0.0, ((ticks1[0] - ticks0[0]) - (_tree_ticks(self._root) - ours0)) / per_s)
            steal = max(0.0, (ticks1[1] - ticks0[1]) / per_s)
        self._start = None
        return Load(seconds, sum(self._samples) / len(self._samples), other, os.cpu_count() or 1, steal)
