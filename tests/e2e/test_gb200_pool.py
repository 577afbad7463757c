"""The gb200 GPU pool for real: a Prefect server on loopback, `gpu_limit_commands("gb200", 4)` run through the
venv's `prefect` CLI, then the kubernetes work pool, its base job template and both concurrency limits read
back from the server, and the `gpu:gb200` limit exercised by Prefect's own `concurrency()`.

No Kubernetes cluster and no `prefect-kubernetes` are needed: the server knows the kubernetes pool type
from its bundled worker metadata; only a kubernetes *worker* needs that package.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from draftsmith.pools import gpu_limit_commands, gpu_limit_name, load_base_job_template

ROOT = Path(__file__).resolve().parents[2]
# The venv's executable, not whatever `prefect` is first on PATH. No resolve(): that would leave the venv.
PREFECT = Path(sys.executable).parent / "prefect"
HOST = "127.0.0.1"
HEALTH_TIMEOUT_S = 90
# Loopback requests never go through a proxy, whatever the environment says.
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))

pytestmark = pytest.mark.e2e


@dataclass
class Server:
    api_url: str
    env: dict[str, str]
    log: Path


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 10) -> object:
    with _HTTP.open(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def _tail(path: Path, chars: int = 8_000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "<no output>"


def _stop(proc: subprocess.Popen, wait_s: float = 20) -> None:
    """SIGTERM by PID (the server stops on one), SIGKILL if it is still there after `wait_s`."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=wait_s)


@pytest.fixture
def prefect_server(tmp_path: Path) -> Iterator[Server]:
    """A private `prefect server` on a free loopback port with its own PREFECT_HOME; stopped by PID."""
    port = _free_port()
    api_url = f"http://{HOST}:{port}/api"
    (home := tmp_path / "prefect-home").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_API_URL=api_url,
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        DO_NOT_TRACK="1",
        NO_PROXY=",".join(filter(None, [HOST, env.get("NO_PROXY")])),
        no_proxy=",".join(filter(None, [HOST, env.get("no_proxy")])),
    )
    log = tmp_path / "server.log"
    with log.open("wb") as fh:
        proc = subprocess.Popen(
            [str(PREFECT), "server", "start", "--host", HOST, "--port", str(port), "--no-ui"],
            cwd=tmp_path,
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        t0 = time.monotonic()
        while True:
            if proc.poll() is not None:
                pytest.fail(f"prefect server exited {proc.returncode}:\n{_tail(log)}")
            try:
                if _get(f"{api_url}/health", timeout=2) is True:
                    break
            except (OSError, ValueError):
                pass
            if time.monotonic() - t0 > HEALTH_TIMEOUT_S:
                pytest.fail(f"prefect server not healthy after {HEALTH_TIMEOUT_S} s:\n{_tail(log)}")
            time.sleep(0.5)
        print(f"\nprefect server healthy on {api_url} after {time.monotonic() - t0:.1f} s")
        yield Server(api_url=api_url, env=env, log=log)
    finally:
        _stop(proc)


def _prefect(server: Server, argv: list[str]) -> subprocess.CompletedProcess:
    """Run a `prefect ...` command line with the venv's executable against `server`."""
    assert argv[0] == "prefect", argv
    return subprocess.run(
        [str(PREFECT), *argv[1:]], cwd=ROOT, env=server.env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.timeout(300)
def test_gpu_limit_commands_set_up_gb200_pool(prefect_server: Server) -> None:
    server = prefect_server
    t0 = time.monotonic()
    commands = gpu_limit_commands("gb200", 4)
    for argv in commands:
        res = _prefect(server, argv)
        assert res.returncode == 0, f"{' '.join(argv)} exited {res.returncode}:\n{res.stdout}{res.stderr}"
    print(f"{len(commands)} commands: {time.monotonic() - t0:.1f} s")

    pool = _get(f"{server.api_url}/work_pools/gb200")
    assert pool["type"] == "kubernetes"
    assert pool["base_job_template"] == load_base_job_template("gb200")
    assert pool["concurrency_limit"] == 1  # one 4-GPU pod at a time on 4 GPUs

    res = _prefect(server, ["prefect", "gcl", "inspect", gpu_limit_name("gb200"), "--output", "json"])
    assert res.returncode == 0, res.stdout + res.stderr
    gcl = json.loads(res.stdout)
    assert (gcl["name"], gcl["limit"], gcl["active"], gcl["active_slots"]) == ("gpu:gb200", 4, True, 0)

    # Setting up twice is refused by name, not silently changed: the caller decides what "exists" means.
    res = _prefect(server, commands[0])
    assert res.returncode == 1 and "already exists" in res.stdout + res.stderr, res.stdout + res.stderr
    _occupy_gpus(server)
    print(f"total after server start: {time.monotonic() - t0:.1f} s")


def _occupy_gpus(server: Server) -> None:
    """A 4-GPU holder takes every slot of `gpu:gb200`; a fifth GPU is then refused until it lets go."""
    from prefect.concurrency.sync import concurrency
    from prefect.settings import PREFECT_API_URL, temporary_settings

    name = gpu_limit_name("gb200")
    url = f"{server.api_url}/v2/concurrency_limits/{name}"
    with temporary_settings({PREFECT_API_URL: server.api_url}):
        with concurrency(name, occupy=4, timeout_seconds=10, strict=True):
            assert _get(url)["active_slots"] == 4
            with pytest.raises(TimeoutError):
                with concurrency(name, occupy=1, timeout_seconds=1, strict=True):
                    pass
        assert _get(url)["active_slots"] == 0
