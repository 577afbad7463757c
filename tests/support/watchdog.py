"""The last resort for a test that hangs where pytest-timeout cannot reach it.

pytest-timeout (`timeout_method = signal`) raises in the main thread when a test overruns its limit, but Python
runs that handler only between bytecodes: a test stuck inside native code (a blocking call of a C++ client, a
collective whose peer is gone) never sees it. It then holds its xdist worker until CI's own limit ends the whole
run, with no word on which test it was. faulthandler's watchdog is a native thread that needs no interpreter: at
the test's limit plus a grace (`watchdog_grace`, seconds) it writes every thread's stack to a file and ends the
worker. xdist reports the test as crashed, starts a new worker for the rest, and the controller prints the
stacks at the end of the run.

`tests/conftest.py` takes these hooks in; the folder of the dumps is shared through the environment, which the
controller sets before it starts its workers.
"""

import faulthandler
import os
import shutil
import tempfile
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

GRACE_INI = "watchdog_grace"
DIR_ENV = "DRAFTSMITH_TEST_WATCHDOG_DIR"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        GRACE_INI,
        "Seconds past a test's pytest-timeout limit after which its process is ended with a stack dump (0: off).",
        default="120",
    )


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the controller, or a run without xdist
        folder = tempfile.mkdtemp(prefix="draftsmith-test-watchdog-")
        os.environ[DIR_ENV] = folder
        config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))


def limit_of(item: pytest.Item) -> float:
    """The test's pytest-timeout limit in seconds (its `timeout` mark, `--timeout`, or the ini); 0: none."""
    mark = item.get_closest_marker("timeout")
    if mark is not None:
        value: Any = mark.args[0] if mark.args else mark.kwargs.get("timeout")
    else:
        value = item.config.getoption("timeout", None) or item.config.getini("timeout")
    return float(value or 0)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    grace, limit, folder = float(item.config.getini(GRACE_INI)), limit_of(item), os.environ.get(DIR_ENV)
    if grace <= 0 or limit <= 0 or not folder:
        yield
        return
    path = Path(folder) / f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-{os.getpid()}.txt"
    with open(path, "w") as dump:
        dump.write(f"{item.nodeid} ran {limit:g} s (its timeout) + {grace:g} s; its process was ended:\n")
        dump.flush()
        faulthandler.dump_traceback_later(limit + grace, exit=True, file=dump)
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()
    path.unlink()


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    folder = os.environ.get(DIR_ENV)
    if hasattr(config, "workerinput") or not folder:
        return
    for dump in sorted(Path(folder).glob("*.txt")):
        terminalreporter.write_sep("=", f"hung test, stacks by the watchdog ({dump.stem})")
        terminalreporter.write_line(dump.read_text(errors="replace").rstrip())
