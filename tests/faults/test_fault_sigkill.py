"""SIGKILL at random points of every stage, then resume: nothing lost, duplicated or corrupted.

The six stage functions run on the tiny recipe in a child process that holds the run folder's lock, as a
pipeline run does. For each stage in turn the child is killed (SIGKILL to its process group) a seeded random
moment after that stage has started, and restarted on the same folder. The finished folder must then hold
byte for byte the artifacts of an uninterrupted run (the session's `tiny_run`): the same conversations,
token shards, hidden-state shards and drafter weights. Evaluation timings differ from run to run, so only
its acceptance figures and outputs are compared.

Run as a module (`python -m tests.faults.test_fault_sigkill RUN_DIR`), this file is the child.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "deployments" / "recipes" / "tiny-cpu.yaml"
STAGES = ["select_prompts", "regenerate", "tokenize", "hidden_states", "train", "evaluate"]
SEED = 20261201
# What differs between two uninterrupted runs of the same inputs: wall-clock figures.
TIMED = {"evaluate": {"results.json", "prompts.jsonl"}, "train": {"metrics.jsonl"}}


def _run_stages(run_dir: str) -> None:
    from draftsmith.core.config import load_recipe
    from draftsmith.core.runlock import hold
    from draftsmith.tasks.evaluate import evaluate
    from draftsmith.tasks.hidden_states import capture_hidden_states
    from draftsmith.tasks.regenerate import regenerate
    from draftsmith.tasks.select_prompts import select_prompts
    from draftsmith.tasks.tokenization import tokenize
    from draftsmith.tasks.train import train

    c = load_recipe(RECIPE)
    with hold(run_dir):
        prompts = select_prompts(c.select, c.target, seed=c.seed, out_uri=f"{run_dir}/select_prompts")
        convs = regenerate(c.regenerate, c.target, prompts, seed=c.seed, out_uri=f"{run_dir}/regenerate")
        tokens = tokenize(c.tokenize, c.target, convs, out_uri=f"{run_dir}/tokenize")
        hidden = capture_hidden_states(c.hidden_states, c.target, tokens, out_uri=f"{run_dir}/hidden_states")
        ckpt = train(
            c.train, c.drafter, c.target, c.hidden_states, tokens, hidden, seed=c.seed, out_uri=f"{run_dir}/train"
        )
        evaluate(c.evaluate, c.drafter, c.target, prompts, ckpt, out_uri=f"{run_dir}/evaluate")


def _start(run_dir: Path, log) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tests.faults.test_fault_sigkill", str(run_dir)]
    return subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)


def _kill_inside(stage: str, run_dir: Path, window_s: float, rng: random.Random, log) -> str:
    """Start the child, wait for `stage` to begin, SIGKILL it `U(0, window_s)` later; what was cut short."""
    child = _start(run_dir, log)
    started = run_dir / stage / ".stage-key"
    deadline = time.monotonic() + 600
    while not started.exists() or (run_dir / stage / "manifest.json").exists():
        if child.poll() is not None:
            return f"{stage}: the child ended ({child.returncode}) before the stage began"
        assert time.monotonic() < deadline, f"{stage} did not start within 600 s"
        time.sleep(0.05)
    time.sleep(rng.uniform(0.0, window_s))
    os.killpg(child.pid, signal.SIGKILL)
    child.wait()
    done = sorted(p.parent.name for p in run_dir.glob("*/manifest.json"))
    return f"{stage}: killed with {done} finished"


def _finish(run_dir: Path, log) -> None:
    """Run to the end; a trainer orphaned by the kill holds the lock for a few seconds: retry then."""
    for _ in range(30):
        child = _start(run_dir, log)
        if child.wait(timeout=900) == 0:
            return
        log.flush()
        if "is in use by pid" not in Path(log.name).read_text()[-4000:]:
            raise AssertionError(f"the resumed run failed; see {log.name}")
        time.sleep(1.0)
    raise AssertionError("the run folder stayed locked for 30 s after the kill")


def _digests(run: Path, stage: str) -> dict[str, str]:
    manifest = json.loads((run / stage / "manifest.json").read_text())
    return {f["name"]: f["digest"] for f in manifest["files"] if f["name"] not in TIMED.get(stage, set())}


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_sigkill_in_every_stage_then_resume_gives_the_uninterrupted_artifacts(tiny_run, tmp_path):
    run_dir, rng = tmp_path / "run", random.Random(SEED)
    reference = Path(tiny_run["run_dir"])
    notes = []
    with open(tmp_path / "child.log", "w") as log:
        for stage in STAGES:
            window = max(0.5, 0.8 * tiny_run[stage].seconds)  # most likely inside the stage's own work
            notes.append(_kill_inside(stage, run_dir, window, rng, log))
        _finish(run_dir, log)
    for stage in STAGES:
        assert _digests(run_dir, stage) == _digests(reference, stage), (stage, notes)
    got = json.loads((run_dir / "evaluate" / "results.json").read_text())
    want = json.loads((reference / "evaluate" / "results.json").read_text())
    assert got["acc_len"] == want["acc_len"] and got["mismatched_outputs"] == 0, notes
    leftovers = [p for p in run_dir.rglob("*.tmp")]
    assert not leftovers, leftovers


if __name__ == "__main__":
    _run_stages(sys.argv[1])
