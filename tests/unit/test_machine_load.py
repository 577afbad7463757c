"""`evals.machine_load`: CPU time is attributed to this process tree or to the rest of the machine."""

import os
import subprocess
import sys
import time

import pytest

from draftsmith.evals import machine_load
from draftsmith.evals.machine_load import Load, LoadMeter

pytestmark = [pytest.mark.unit, pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs /proc")]
SPIN = "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass\n"
HZ = os.sysconf("SC_CLK_TCK")


def test_a_childs_cpu_time_is_ours_and_an_orphans_is_not():
    before = machine_load._tree_ticks(os.getpid())
    subprocess.run([sys.executable, "-c", SPIN], check=True)
    ours = machine_load._tree_ticks(os.getpid()) - before
    assert ours >= 0.5 * HZ, "a child's CPU time (reaped: in our cutime) counts as this tree's"
    # A grandchild whose parent exits is re-parented outside this tree: its CPU time is another process's.
    orphan = [sys.executable, "-c", f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {SPIN!r}])"]
    before = machine_load._tree_ticks(os.getpid())
    subprocess.run(orphan, check=True)
    time.sleep(1.2)
    assert machine_load._tree_ticks(os.getpid()) - before < 0.4 * HZ


def test_a_span_reports_load_average_and_others_share_and_flags_a_busy_machine():
    meter = LoadMeter()
    meter.start()
    subprocess.run([sys.executable, "-c", SPIN], check=True)
    load = meter.stop()
    assert load.seconds > 0.5 and load.load_avg_1m >= 0 and load.cores == os.cpu_count()
    assert load.other_cores is not None and load.other_cores >= 0
    with pytest.raises(RuntimeError, match="before start"):
        meter.stop()
    assert load.steal_cores is not None and load.steal_cores >= 0
    assert Load(10, 1.0, 0.1, 2).busy is False and Load(10, 4.0, 0.9, 2).busy is True
    assert Load(10, 4.0, None, 2).to_dict() == {
        "seconds": 10, "load_avg_1m": 4.0, "other_cores": None, "steal_cores": None, "cores": 2, "busy": False
    }  # fmt: skip


def test_steal_is_the_hosts_share_apart_from_other_processes_and_makes_a_machine_busy(monkeypatch):
    """A fake `/proc/stat`: over the span the host steals 1.2 cores' worth and nothing else runs."""
    stats = iter([(1000, 50), (1000, 50 + 12 * HZ)])  # (this machine's work, steal) in ticks, 10 s apart
    clock = iter([100.0, 110.0])
    monkeypatch.setattr(machine_load, "_cpu_ticks", lambda: next(stats))
    monkeypatch.setattr(machine_load, "_tree_ticks", lambda root: 0)
    monkeypatch.setattr(machine_load.time, "monotonic", lambda: next(clock))
    meter = LoadMeter()
    meter.start()
    load = meter.stop()
    assert load.other_cores == 0.0 and load.steal_cores == pytest.approx(1.2)
    assert load.busy, "a host taking 1.2 of the cores leaves no idle machine's timing"
    assert Load(10, 1.0, 0.2, 2, steal_cores=0.2).busy is False
    assert Load(10, 1.0, 0.2, 2, steal_cores=0.4).busy is True, "other processes and steal add up"
