"""One writer per run folder: a second `draftsmith run` on a held folder stops at once with one line naming the
holder (exit 2) and takes the folder over once that process is dead; a killed write's temp file is cleaned."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import draftsmith.flows.pipeline
from draftsmith import cli
from draftsmith.core import runlock, storage
from draftsmith.core.stage import StageResult, run_stage
from tests.support.paths import RECIPES

ROOT = Path(__file__).resolve().parents[2]
_HOLD = """
import sys, time
from draftsmith.core import runlock
with runlock.hold(sys.argv[1]):
    print("held", flush=True)
    time.sleep(120)
"""


@pytest.fixture(autouse=True)
def _own_environ(monkeypatch):
    # cli.main sets its environment defaults (PREFECT_HOME, ...) in this process: keep them from other tests.
    monkeypatch.setattr(os, "environ", os.environ.copy())


@pytest.fixture
def reached(monkeypatch) -> list[str]:
    """`kimi_k3`'s own body without Prefect's engine; its first stage only records that the run got there."""
    stages: list[str] = []

    def here(config, stage, run_dir, inputs):
        stages.append(stage)
        raise ValueError("stopped at the first stage")

    monkeypatch.setattr(draftsmith.flows.pipeline, "run_here", here)
    monkeypatch.setattr(draftsmith.flows.pipeline, "kimi_k3", draftsmith.flows.pipeline.kimi_k3.fn)
    monkeypatch.delenv("DRAFTSMITH_DEBUG", raising=False)
    return stages


def _holder(run_dir: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def _run(run_dir: Path, capsys) -> tuple[int, list[str]]:
    code = cli.main(["run", str(RECIPES / "tiny-cpu.yaml"), "--run-dir", str(run_dir)])
    return code, [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_second_run_on_a_held_folder_fails_naming_the_holder_then_takes_over(reached, tmp_path, capsys):
    run_dir = tmp_path / "run"
    holder = _holder(run_dir)
    try:
        t0 = time.monotonic()
        code, errors = _run(run_dir, capsys)
        waited = time.monotonic() - t0
        assert code == 2, errors
        assert reached == [], "the second run went on into the stages"
        want = f"error: run folder {run_dir} is in use by pid {holder.pid} on {socket.gethostname()} since "
        assert len(errors) == 1 and errors[0].startswith(want), errors
        assert "(started by: " in errors[0] and "-c" in errors[0]
        assert waited < 30, f"took {waited:.1f} s to refuse"
        assert not (run_dir / "recipe.yaml").exists(), "the refused run wrote into the folder"
    finally:
        holder.kill()
        holder.wait()
    # Killed: the kernel dropped its lock, and only its record is left for the next run to replace.
    assert json.loads((run_dir / runlock.LOCK_NAME).read_text())["pid"] == holder.pid
    code, errors = _run(run_dir, capsys)
    assert reached == ["select_prompts"], errors
    assert code == 2 and errors == ["error: select_prompts: stopped at the first stage"]
    # This run has ended (with an error, but not killed): it leaves no record for the next to take over from.
    assert runlock.read_holder(run_dir / runlock.LOCK_NAME) is None


@pytest.mark.unit
def test_nested_hold_in_one_process_is_not_a_second_writer(tmp_path):
    with runlock.hold(str(tmp_path)), runlock.hold(str(tmp_path)):
        assert len(runlock.inherited_fds()) == 1
    assert runlock.inherited_fds() == ()


_KILLED_WRITE = """
import os, signal, sys
from draftsmith.core import storage
os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)  # die between the temp file and its rename
storage.write_jsonl(sys.argv[1], [{"id": 1}])
"""


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_temp_file_of_a_killed_write_is_removed_on_resume(tmp_path):
    stage = tmp_path / "hidden_states"
    proc = subprocess.run([sys.executable, "-c", _KILLED_WRITE, str(stage / "index.jsonl")], cwd=ROOT, check=False)
    assert proc.returncode == -signal.SIGKILL
    left = [p.name for p in stage.iterdir()]
    assert len(left) == 1 and left[0].startswith(".index.jsonl.") and left[0].endswith(".tmp"), left
    storage.write_bytes(str(stage / "shard-00000.safetensors"), b"kept")
    (stage / "notes.tmp").write_text("not ours: kept")

    (stage / "commits").mkdir()
    nested = stage / "commits" / left[0]
    nested.write_bytes(b"half")

    def resume(uri: str) -> StageResult:
        seen.extend(sorted(str(p.relative_to(stage)) for p in stage.rglob("*") if p.is_file()))
        return StageResult(files=[])

    seen: list[str] = []
    with runlock.hold(str(tmp_path)):  # every stage clears them before it resumes its writer
        run_stage("hidden_states", str(stage), "k", resume)
    assert seen == [".stage-key", "notes.tmp", "shard-00000.safetensors"]
