"""`draftsmith run` refuses a run folder it cannot own before it starts the temporary Prefect server: a folder
another run holds, or one it cannot write (read-only), ends in one line and exit 2 at once, where it used to
cost the server's start-up (98 s under load) first. A run that ends leaves no holder record behind, so a
rerun does not report taking the folder over; and the end-of-run table says which stages were reused.

Whether the server started is read from the refused run's own PREFECT_HOME: the temporary server creates
its database there (`prefect.db`) as it starts.
"""

import logging
import os
import socket
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from draftsmith import cli
from draftsmith.core import runlock
from draftsmith.core.manifest import StageManifest
from tests.support.paths import ROOT, TINY

_HOLD = """
import sys, time
from draftsmith.core import runlock
with runlock.hold(sys.argv[1]):
    print("held", flush=True)
    time.sleep(300)
"""
# Bind-mounts the run folder read-only over itself in a private mount namespace, then runs the command: root
# writes through file modes, not through a read-only mount.
_READ_ONLY = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" "$0" && exec "$@"'


def _draftsmith_run(tmp_path: Path, run_dir: Path, prefix: tuple[str, ...] = ()) -> tuple[int, list[str]]:
    """`draftsmith run` of the tiny recipe in its own process with its own PREFECT_HOME and no server URL, so
    that it would start a temporary server; its exit code and `error:` lines."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env |= {"PREFECT_HOME": str(tmp_path / "prefect"), "DRAFTSMITH_DEBUG": "0"}
    cmd = [*prefix, sys.executable, "-m", "draftsmith.cli", "run", str(TINY), "--run-dir", str(run_dir)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.returncode, errors


def _server_started(tmp_path: Path) -> bool:
    return any((tmp_path / "prefect").glob("prefect.db*"))


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_held_run_folder_is_refused_before_the_prefect_server_starts(tmp_path):
    run_dir = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        code, errors = _draftsmith_run(tmp_path, run_dir)
    finally:
        holder.kill()
        holder.wait()
    want = f"error: run folder {run_dir} is in use by pid {holder.pid} on {socket.gethostname()} since "
    assert code == 2 and len(errors) == 1 and errors[0].startswith(want), (code, errors)
    assert not _server_started(tmp_path), "the refused run started a Prefect server first"
    assert not (run_dir / "recipe.yaml").exists(), "the refused run wrote into the folder"


def _read_only_prefix(run_dir: Path) -> tuple[str, ...]:
    if os.geteuid() != 0:
        run_dir.chmod(0o555)
        return ()
    probe = subprocess.run(["unshare", "-m", "sh", "-c", _READ_ONLY, str(run_dir), "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a folder read-only here: {probe.stderr.decode(errors='replace').strip()}")
    return ("unshare", "-m", "sh", "-c", _READ_ONLY, str(run_dir))


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_read_only_run_folder_is_refused_in_one_line_before_the_prefect_server_starts(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    try:
        code, errors = _draftsmith_run(tmp_path, run_dir, _read_only_prefix(run_dir))
    finally:
        run_dir.chmod(0o755)
    assert code == 2, errors
    assert len(errors) == 1 and errors[0].startswith(f"error: {run_dir}/.lock: write refused by the filesystem: ")
    assert not _server_started(tmp_path), "the refused run started a Prefect server first"


@pytest.mark.unit
def test_a_run_that_ends_leaves_no_holder_to_take_over_from(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="draftsmith.core.runlock")
    lock = tmp_path / runlock.LOCK_NAME
    for _ in range(2):
        with runlock.hold(str(tmp_path)):
            assert (runlock.read_holder(lock) or {}).get("pid") == os.getpid()
        assert runlock.read_holder(lock) is None
    with pytest.raises(RuntimeError, match="a stage failed"), runlock.hold(str(tmp_path)):
        raise RuntimeError("a stage failed")
    assert runlock.read_holder(lock) is None
    assert "taking over" not in caplog.text


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_the_record_stays_while_a_child_that_inherited_the_lock_still_writes(tmp_path):
    with runlock.hold(str(tmp_path)):
        child = subprocess.Popen(["sleep", "60"], pass_fds=runlock.inherited_fds())
    try:
        # The child (a trainer) keeps the folder locked after its parent let go; the record names the parent.
        with pytest.raises(runlock.RunFolderBusy, match=f"in use by pid {os.getpid()} "), runlock.hold(str(tmp_path)):
            pass
    finally:
        child.kill()
        child.wait()
    with runlock.hold(str(tmp_path)):  # the child is gone: the folder is free again
        pass
    assert runlock.read_holder(tmp_path / runlock.LOCK_NAME) is None


@pytest.mark.unit
def test_the_end_of_run_table_shows_a_reused_stage_as_reused_not_its_old_seconds():
    started = datetime.now(UTC)
    old = (started - timedelta(hours=3)).isoformat()
    manifests = {
        "select_prompts": StageManifest(stage="select_prompts", key="k1", uri=".", seconds=41.5, created_at=old),
        "hidden_states": None,
        "train": StageManifest(stage="train", key="k2", uri=".", seconds=12.34),
    }
    rows = cli._stage_table(manifests, started).splitlines()[2:]
    assert rows[0].split() == ["select_prompts", "-", "cached", "(reused", "from", f"{old[:19]})"]
    assert "41.5" not in rows[0]
    assert rows[1].split() == ["hidden_states", "-", "skipped"]
    assert rows[2].split() == ["train", "12.3", "ran"]
