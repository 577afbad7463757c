"""`core/proctree.py`: descendants found through /proc, parents first, whatever the command names hold; zombies
and gone processes told apart from live ones."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from draftsmith.core import proctree

pytestmark = [pytest.mark.unit, pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc")]

# A child that renames itself with spaces and parentheses (as some workers do), starts a grandchild, then waits.
_CHILD = """
import subprocess, sys, time
open("/proc/self/comm", "w").write("odd) name (x")
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(grandchild.pid, flush=True)
time.sleep(60)
"""


def _state(pid: int) -> str | None:
    fields = proctree.stat_fields(pid)
    return None if fields is None else fields[0]


def test_descendants_parents_first_and_alive_until_reaped():
    child = subprocess.Popen([sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, text=True)
    grandchild = None
    try:
        assert child.stdout is not None
        grandchild = int(child.stdout.readline())
        assert Path(f"/proc/{child.pid}/comm").read_text().strip() == "odd) name (x"
        found = proctree.descendants(os.getpid())
        assert found.index(child.pid) < found.index(grandchild)  # parents before their children
        assert proctree.descendants(child.pid) == [grandchild]
        fields = proctree.stat_fields(child.pid)
        assert fields is not None and int(fields[1]) == os.getpid()  # ppid, despite the command name
        assert proctree.process_alive(child.pid) and proctree.process_alive(grandchild)
    finally:
        child.kill()
        if grandchild is not None:
            os.kill(grandchild, 9)
    deadline = time.monotonic() + 5
    while _state(child.pid) not in ("Z", None):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert not proctree.process_alive(child.pid)  # a zombie until reaped counts as gone
    child.wait()
    assert proctree.stat_fields(child.pid) is None and not proctree.process_alive(child.pid)
