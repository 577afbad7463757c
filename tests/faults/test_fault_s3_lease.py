"""One writer per run folder on S3 too: a second run fails naming the holder while the lease is renewed, a
killed run's lease is taken over once it has expired, and a finished run leaves no lease behind. Against a
real S3 server (SeaweedFS), whose conditional puts (`If-None-Match`, `If-Match`) the lease relies on."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import s3fs

from draftsmith.core import runlock
from tests.support.s3 import weed_s3

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]
LEASE_S = 10.0
# A second run in its own process: holds the folder for argv[2] seconds, or reports why it cannot.
_RUN = """
import sys, time
from draftsmith.core.runlock import RunFolderBusy, hold
try:
    with hold(sys.argv[1], lease_s=float(sys.argv[3])):
        print("held", flush=True)
        time.sleep(float(sys.argv[2]))
except RunFolderBusy as err:
    print(err, flush=True)
    sys.exit(2)
"""


@pytest.fixture
def s3(tmp_path, monkeypatch):
    (tmp_path / "weed").mkdir()
    with weed_s3(tmp_path / "weed") as env:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        s3fs.S3FileSystem.clear_instance_cache()  # one made for another server's endpoint
        yield env
        s3fs.S3FileSystem.clear_instance_cache()


def _other(url: str, seconds: float, **kw) -> subprocess.Popen:
    cmd = [sys.executable, "-c", _RUN, url, str(seconds), str(LEASE_S)]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True, env=os.environ.copy(), **kw)


def _lease(url: str) -> dict:
    """The lease record of the run folder at `url` (`{}` when none is held)."""
    from draftsmith.core import storage

    lock = storage.join(url, runlock.LOCK_NAME)
    return json.loads(storage.read_bytes(lock)) if storage.exists(lock) else {}


def test_a_second_run_fails_naming_the_holder_while_the_lease_is_renewed(s3) -> None:
    url = "s3://draftsmith/runs/held"
    with runlock.hold(url, lease_s=LEASE_S):
        first = _lease(url)
        assert first["pid"] == os.getpid()
        time.sleep(LEASE_S * 1.2)  # past the first expiry: only renewal keeps the folder ours
        assert _lease(url)["expires"] > first["expires"]
        other = _other(url, 0)
        out, _ = other.communicate(timeout=120)
        assert other.returncode == 2, out
        assert f"run folder {url} is in use by pid {os.getpid()}" in out, out
    assert _lease(url) == {}  # released: the lease object is deleted, so the next run starts at once
    again = _other(url, 0)
    assert again.communicate(timeout=120)[0].strip() == "held" and again.returncode == 0


def test_a_killed_runs_lease_is_taken_over_once_it_has_expired(s3) -> None:
    url = "s3://draftsmith/runs/killed"
    killed = _other(url, 600)
    assert killed.stdout is not None and killed.stdout.readline().strip() == "held"
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    with pytest.raises(runlock.RunFolderBusy, match=f"in use by pid {killed.pid}"):
        with runlock.hold(url, lease_s=LEASE_S):
            pass
    expires = _lease(url)["expires"]
    start = time.monotonic()
    while True:  # the dead run's lease runs out; then this run takes it over
        try:
            with runlock.hold(url, lease_s=LEASE_S):
                assert _lease(url)["pid"] == os.getpid()
            break
        except runlock.RunFolderBusy:
            assert time.monotonic() - start < LEASE_S * 3, f"not taken over although it expired at {expires}"
            time.sleep(0.5)
    assert time.monotonic() - start <= LEASE_S + 5
