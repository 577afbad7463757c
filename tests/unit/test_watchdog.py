"""The test watchdog (tests/support/watchdog.py) ends a test that pytest-timeout cannot interrupt, under
`make test`'s own scheduler: the hung test is reported crashed with its stacks, and the rest of its file and the
other files still run. A passing test leaves no dump behind."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.watchdog import DIR_ENV

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]

CONFTEST = """
from tests.support.watchdog import pytest_addoption, pytest_configure, pytest_runtest_protocol, pytest_terminal_summary


def pytest_xdist_make_scheduler(config, log):
    from tests.support.lanes import LaneScheduling

    return LaneScheduling(config, log)
"""

STUCK = """
import signal
import time

import pytest


@pytest.mark.timeout(1)
def test_stuck():
    # pytest-timeout's alarm stays pending, as it does for a thread blocked in native code
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    time.sleep(60)


def test_after_the_stuck_one():
    assert True
"""

OTHER = """
import pytest


@pytest.mark.timeout(5)
@pytest.mark.parametrize("n", range(3))
def test_other(n):
    assert n < 3
"""


@pytest.mark.timeout(120)
def test_a_test_out_of_pytest_timeouts_reach_is_ended_with_its_stacks(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_stuck.py").write_text(STUCK)
    (tmp_path / "test_other.py").write_text(OTHER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_") and k != DIR_ENV}
    env["PYTHONPATH"] = str(ROOT)
    run = [sys.executable, "-m", "pytest", "-p", "xdist", "-n", "3", "--dist", "loadfile", "-o", "watchdog_grace=1"]
    done = subprocess.run(
        [*run, "-p", "no:cacheprovider", "-q", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "1 failed, 4 passed" in out, out
    assert "crashed while running 'test_stuck.py::test_stuck'" in out, out
    assert "hung test, stacks by the watchdog" in out, out
    assert "test_stuck.py::test_stuck ran 1 s (its timeout) + 1 s; its process was ended" in out, out
    assert 'File "' + str(tmp_path / "test_stuck.py") + '", line 12 in test_stuck' in out, out
    assert out.count("ran 1 s (its timeout)") == 1, out  # the passing tests left no dump
