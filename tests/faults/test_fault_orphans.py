"""No orphans: SIGKILL of the process that launched torchrun takes torchrun and every rank with it within a few
seconds, and until then torchrun holds the run folder's lock, so a rerun cannot start beside an old trainer.

Run as a module (`python -m tests.faults.test_fault_orphans PID_DIR`), this file is the rank: it records its pid
and its parent's (torchrun) and sleeps.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_LAUNCHER = """
import contextlib, logging, sys
try:
    from draftsmith.core.runlock import hold
except ImportError:
    hold = lambda run_dir: contextlib.nullcontext()
from draftsmith.drafters.training.torchrun import TorchrunSpec, run_torchrun
run_dir, pid_dir, root = sys.argv[1:4]
spec = TorchrunSpec(module="tests.faults.test_fault_orphans", args=[pid_dir], nnodes=1, nproc_per_node=2,
                    threads_per_rank=1)
with hold(run_dir):
    run_torchrun(spec, log=logging.getLogger("launcher"), env={"PYTHONPATH": root}, timeout_s=300)
"""
DEATH_S = 5.0


def _alive(pid: int) -> bool:
    from draftsmith.core.proctree import process_alive

    return process_alive(pid)


def _wait_for_ranks(pid_dir: Path, launcher: subprocess.Popen) -> dict[int, int]:
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        files = list(pid_dir.glob("*.pid"))
        if len(files) == 2:
            return {int(f.stem): int(f.read_text()) for f in files}
        assert launcher.poll() is None, "the launcher exited before its ranks started"
        time.sleep(0.1)
    raise AssertionError("the ranks did not start within 90 s")


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_sigkill_of_the_launcher_leaves_no_torchrun_or_rank(tmp_path):
    run_dir, pid_dir = tmp_path / "run", tmp_path / "pids"
    pid_dir.mkdir()
    launcher = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER, str(run_dir), str(pid_dir), str(ROOT)], cwd=ROOT
    )  # fmt: skip
    pids: list[int] = []
    try:
        ranks = _wait_for_ranks(pid_dir, launcher)
        torchrun = set(ranks.values())
        assert len(torchrun) == 1, ranks
        pids = [*ranks, *torchrun]
        # torchrun holds the lock file open: the folder stays taken while it lives, whoever started it.
        lock = str((run_dir / ".lock").resolve())
        fds = [os.readlink(p) for p in Path(f"/proc/{next(iter(torchrun))}/fd").iterdir()]

        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + DEATH_S
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [p for p in pids if _alive(p)]
        assert not left, f"still running {DEATH_S:g} s after the launcher was killed: {left} of {pids}"
        assert lock in fds, f"torchrun did not hold the run folder's lock file open: {fds}"

        from draftsmith.core import runlock

        # Nobody holds it any more, within the same bound: a helper process the ranks started (not among the
        # recorded pids) can still be closing its inherited copy of the lock file for a moment on a loaded machine.
        deadline = time.monotonic() + DEATH_S
        while True:
            try:
                with runlock.hold(str(run_dir)):
                    break
            except runlock.RunFolderBusy:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    finally:
        launcher.kill()
        launcher.wait()
        for pid in pids:  # never leave them behind, even when the test fails
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


# The tokenize stage's pool, as the stage starts it, both workers busy; the owner records their pids and sleeps.
_POOL_OWNER = """
import json, multiprocessing as mp, os, sys, time
from draftsmith.tasks import token_encode
tok_path, out = sys.argv[1:3]
opts = token_encode.Options(64, "truncate", False, 0)
pool = mp.get_context("spawn").Pool(2, token_encode._init_worker, (tok_path, "chat_template", opts, True, os.getpid()))
pool.apply(token_encode.worker_template_sha256)  # the workers are up
busy = [pool.apply_async(time.sleep, (100,)) for _ in range(2)]  # as in a long shard, deaf to the queue
time.sleep(0.5)
open(out + ".tmp", "w").write(json.dumps([p.pid for p in mp.active_children()]))
os.replace(out + ".tmp", out)
time.sleep(120)
"""


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_sigkill_of_the_tokenize_stage_leaves_no_pool_worker(tiny_cfg, tmp_path):
    from draftsmith.core.target_setup import resolve_target

    tok_path = str(resolve_target(tiny_cfg.target.source, tokenizer_only=True))
    out = tmp_path / "workers.json"
    owner = subprocess.Popen([sys.executable, "-c", _POOL_OWNER, tok_path, str(out)], cwd=ROOT)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 90
        while not out.exists():
            assert owner.poll() is None and time.monotonic() < deadline, "the pool did not start"
            time.sleep(0.1)
        workers = json.loads(out.read_text())
        assert len(workers) == 2 and all(_alive(p) for p in workers), workers
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        deadline = time.monotonic() + DEATH_S
        while any(_alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in workers if _alive(p)], f"pool workers still running {DEATH_S:g} s after the kill"
    finally:
        owner.kill()
        owner.wait()
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


if __name__ == "__main__":
    try:
        from draftsmith.core.procs import die_with_parent
    except ImportError:
        pass
    else:
        die_with_parent()  # what draftsmith.drafters.training.worker does first
    # Written aside, then renamed: the test polls for the files and must never read one half-written.
    aside = Path(sys.argv[1], f"{os.getpid()}.tmp")
    aside.write_text(str(os.getppid()))
    os.replace(aside, aside.with_suffix(".pid"))
    time.sleep(120)


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_sigterm_to_draftsmith_run_stops_its_prefect_server_and_releases_the_folder(tmp_path):
    from draftsmith.core import runlock
    from draftsmith.core.proctree import descendants
    from tests.support.paths import TINY

    run_dir = tmp_path / "run"
    # Its own temporary server, as a user's `draftsmith run` without a configured Prefect API starts.
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"} | {"PYTHONUNBUFFERED": "1"}
    run = subprocess.Popen(
        [sys.executable, "-m", "draftsmith.cli", "run", str(TINY), "--run-dir", str(run_dir)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert run.stdout is not None
    try:
        for line in run.stdout:  # the temporary server answers once the first stage has started
            if "select_prompts" in line:
                break
        below = {p for p in descendants(run.pid) if _alive(p)}
        assert below, "draftsmith run started no server process"
        run.send_signal(signal.SIGTERM)
        rc = run.wait(timeout=90)
    finally:
        if run.poll() is None:
            run.kill()
    assert rc != 0
    deadline = time.monotonic() + 30
    while (left := {p for p in below if _alive(p)}) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes left behind by a terminated run: {sorted(left)}"
    assert not runlock.read_holder(run_dir / ".lock"), "a terminated run must release the run folder"
