"""Shared fixtures: the tiny recipe, its target, and one tiny run of the stage functions."""

import atexit
import fcntl
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

# `python -m pytest` puts the checkout first on sys.path, where its top-level folders (kernels/, core/, ...),
# draftsmith's subpackages, would shadow installed packages of the same name: transformers imports `kernels`.
# The checkout stays on the path, for `tests.*`, but last.
_CHECKOUT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _CHECKOUT] + [str(_CHECKOUT)]

import pytest  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
# Triton reads it at import: kernels forced to Triton in tests/kernels run interpreted on CPU tensors.
os.environ.setdefault("TRITON_INTERPRET", "1")
# `make test` runs three pytest-xdist workers: each gets its own Prefect home, so that temporary Prefect
# servers never share a database, and one torch thread, so that the workers do not fight over 2 cores.
if "PREFECT_HOME" not in os.environ:
    os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="draftsmith-test-prefect-")
    atexit.register(shutil.rmtree, os.environ["PREFECT_HOME"], True)
if os.environ.get("PYTEST_XDIST_WORKER"):
    import torch

    torch.set_num_threads(1)

from tests.support import venvs  # noqa: E402 - importable once the checkout is on the path
from tests.support.paths import RECIPES  # noqa: E402

# A test stuck in native code, out of pytest-timeout's reach, is ended with its stacks (tests/support/watchdog.py).
from tests.support.watchdog import (  # noqa: E402, F401 - hooks, found by name
    pytest_addoption,
    pytest_configure,
    pytest_runtest_protocol,
    pytest_terminal_summary,
)


@pytest.fixture(scope="session")
def tiny_cfg():
    from draftsmith.core.config import load_recipe

    return load_recipe(RECIPES / "tiny-cpu.yaml")


@pytest.fixture(scope="session")
def tiny_target(tiny_cfg):
    from draftsmith.engines import hf

    return hf.load_target(tiny_cfg.target)


@pytest.fixture(scope="session")
def tiny_run(tiny_cfg, tmp_path_factory):
    """Every stage function run once, in order, on the tiny recipe: `{stage: manifest}`.

    One run folder for the whole session, shared by `make test`'s workers: the first to get here runs the
    stages under a file lock, the others then call the same functions on the finished folder, where every stage
    is reused from its manifest (what a resumed run does). Tests write only into subfolders of their own."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # xdist: one basetemp per worker
    with open(shared / "tiny-run.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _tiny_run(tiny_cfg, str(shared / "tiny-run"))


def _tiny_run(tiny_cfg, run: str) -> dict[str, Any]:
    from draftsmith.tasks.evaluate import evaluate
    from draftsmith.tasks.hidden_states import capture_hidden_states
    from draftsmith.tasks.regenerate import regenerate
    from draftsmith.tasks.select_prompts import select_prompts
    from draftsmith.tasks.tokenization import tokenize
    from draftsmith.tasks.train import train

    c = tiny_cfg
    out: dict[str, Any] = {
        "select_prompts": select_prompts(c.select, c.target, seed=c.seed, out_uri=f"{run}/select_prompts")
    }
    out["regenerate"] = regenerate(
        c.regenerate, c.target, out["select_prompts"], seed=c.seed, out_uri=f"{run}/regenerate"
    )
    out["tokenize"] = tokenize(c.tokenize, c.target, out["regenerate"], out_uri=f"{run}/tokenize")
    out["hidden_states"] = capture_hidden_states(
        c.hidden_states, c.target, out["tokenize"], out_uri=f"{run}/hidden_states"
    )
    out["train"] = train(
        c.train,
        c.drafter,
        c.target,
        c.hidden_states,
        out["tokenize"],
        out["hidden_states"],
        seed=c.seed,
        out_uri=f"{run}/train",
    )
    out["evaluate"] = evaluate(
        c.evaluate, c.drafter, c.target, out["select_prompts"], out["train"], out_uri=f"{run}/evaluate"
    )
    out["run_dir"] = run
    return out


def pytest_collection_modifyitems(config, items):
    # Slow files first, so they do not end up together at the tail: `make test` keeps this order for its
    # scheduler (`--no-loadscope-reorder`; xdist's default sends the files with the most tests first instead).
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # Before any fixture: a module fixture that starts a vLLM server must not run before its venv exists.
    for mark in item.iter_markers("venv"):
        venvs.require(*mark.args)


def pytest_xdist_make_scheduler(config, log):
    # `--dist loadfile`, and with three workers or more (`make test`) the last a lane for the files that mostly
    # wait (tests/support/lanes.py).
    if config.getvalue("dist") == "loadfile":
        from tests.support.lanes import LaneScheduling

        return LaneScheduling(config, log)
    return None
