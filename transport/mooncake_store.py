"""A local Mooncake master (process management) and a connection to a Mooncake distributed store.

`MooncakeMaster` starts `mooncake_master` with its embedded HTTP metadata server on loopback ports that
are free at start time, waits until both the RPC and the metadata ports accept connections, and stops it
by PID (SIGTERM, then SIGKILL) on exit; it dies with the process that started it, even a SIGKILLed one.
`MooncakeSettings` is everything a client needs to join the store, as plain JSON-serialisable fields
(`dataclasses.asdict`), so a producer started in another process or host is configured from one JSON
object. `connect(settings)` returns a set-up `MooncakeDistributedStore`.
"""

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from draftsmith.core import procs

# Mooncake error codes seen on this version (mooncake-store/include/types.h).
NO_AVAILABLE_HANDLE = -200  # the global segments are full: back-pressure, retry later
OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706


@dataclass(frozen=True)
class MooncakeSettings:
    """How one client joins a store; `global_segment_bytes` is the memory this client lends the pool."""

    master_addr: str
    metadata_url: str
    local_hostname: str = "127.0.0.1"
    global_segment_bytes: int = 256 << 20
    local_buffer_bytes: int = 64 << 20
    protocol: str = "tcp"
    device: str = ""

    def to_json_dict(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, **changes) -> "MooncakeSettings":
        return dataclasses.replace(self, **changes)


def connect(settings: MooncakeSettings):
    """A `MooncakeDistributedStore` joined to `settings.master_addr`; raises `ConnectionError` on failure."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup(
        settings.local_hostname,
        settings.metadata_url,
        settings.global_segment_bytes,
        settings.local_buffer_bytes,
        settings.protocol,
        settings.device,
        settings.master_addr,
    )
    if rc != 0:
        raise ConnectionError(
            f"Mooncake setup failed with rc={rc}: master {settings.master_addr}, metadata {settings.metadata_url}, "
            f"local_hostname {settings.local_hostname}, protocol {settings.protocol}"
        )
    return store


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that nothing listens on right now (the OS picks it; a race is possible but rare)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_listening(host: str, port: int, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    """Block until `host:port` accepts a TCP connection; raise `TimeoutError` (or early if `proc` died)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            pass
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process {proc.pid} exited with rc={proc.returncode} before {host}:{port} listened")
        if time.monotonic() > deadline:
            raise TimeoutError(f"nothing listens on {host}:{port} after {timeout_s:.0f} s")
        time.sleep(0.05)


def master_answers(master_addr: str, timeout_s: float = 2.0, settle_s: float = 0.0) -> str | None:
    """None if `master_addr` ("host:port") accepts TCP connections now and for `settle_s` more, else why not.

    Mooncake's own calls against a dead master fail with rc -900 (RPC failed) and do not say where the
    master is; this probe tells "the master is gone" apart from a failure of one key. After a call failed,
    give it a `settle_s`: a SIGKILLed process drops its connections first and still accepts new ones until
    the kernel has closed its listening socket.
    """
    host, _, port = master_addr.rpartition(":")
    deadline = time.monotonic() + settle_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=timeout_s):
                pass
        except ValueError:
            return f"{master_addr!r} is not host:port"
        except TimeoutError:
            return f"no answer within {timeout_s:g} s"
        except OSError as e:
            return e.strerror.lower() if e.strerror else str(e)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.1)


def stop_process(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM `proc` by PID, then SIGKILL if it has not exited within `grace_s`."""
    if proc.poll() is not None:
        return
    os.kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=grace_s)


def venv_bin(name: str) -> Path:
    """`name` next to the running interpreter (the venv's bin dir), where pip puts Mooncake's binaries."""
    path = Path(sys.executable).parent / name
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: install mooncake-transfer-engine(-non-cuda) in this venv")
    return path


class MooncakeMaster:
    """`mooncake_master` with its HTTP metadata server on free loopback ports, for one `with` block.

    `settings(...)` gives the `MooncakeSettings` a client of this master uses; `log_path` holds its output.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        log_dir: str | os.PathLike | None = None,
        start_timeout_s: float = 20.0,
        extra_args: tuple[str, ...] = (),
    ):
        self.host = host
        self.rpc_port = free_port(host)
        self.metadata_port = free_port(host)
        self.metrics_port = free_port(host)
        self.log_path = Path(log_dir or tempfile.mkdtemp(prefix="mooncake-")) / f"master-{self.rpc_port}.log"
        self.start_timeout_s = start_timeout_s
        self.extra_args = tuple(extra_args)
        self.proc: subprocess.Popen | None = None

    @property
    def master_addr(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://{self.host}:{self.metadata_port}/metadata"

    def settings(self, **overrides) -> MooncakeSettings:
        return MooncakeSettings(master_addr=self.master_addr, metadata_url=self.metadata_url, **overrides)

    def start(self) -> "MooncakeMaster":
        cmd = [
            str(venv_bin("mooncake_master")),
            f"--rpc_address={self.host}",
            f"--rpc_port={self.rpc_port}",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={self.host}",
            f"--http_metadata_server_port={self.metadata_port}",
            f"--metrics_host={self.host}",
            f"--metrics_port={self.metrics_port}",
            *self.extra_args,
        ]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            # An orphaned master would keep its ports and the pool's metadata forever: it dies with us.
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, **procs.popen_kwargs()
            )
        try:
            wait_listening(self.host, self.rpc_port, self.start_timeout_s, self.proc)
            wait_listening(self.host, self.metadata_port, self.start_timeout_s, self.proc)
        except Exception as e:
            self.stop()
            raise RuntimeError(
                f"mooncake_master on {self.master_addr} did not start ({e}); log: {self.log_path}"
            ) from e
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)

    def __enter__(self) -> "MooncakeMaster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
