"""A private Prefect server for e2e tests: free loopback port, its own PREFECT_HOME, stopped by PID."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The venv's executables, not whatever is first on PATH. No resolve(): that would leave the venv.
PREFECT = Path(sys.executable).parent / "prefect"
DRAFTSMITH = Path(sys.executable).parent / "draftsmith"
HOST = "127.0.0.1"
HEALTH_TIMEOUT_S = 90
# Loopback requests never go through a proxy, whatever the environment says.
HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass
class Server:
    api_url: str
    env: dict[str, str]
    log: Path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def server_env(home: Path, api_url: str) -> dict[str, str]:
    """The caller's environment minus any Prefect settings of its own, plus a private server's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_API_URL=api_url,
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        # No scheduled runs: a `--run-once` worker must find only the run a test started, whatever the hour.
        PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED="false",
        DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        NO_PROXY=",".join(filter(None, [HOST, env.get("NO_PROXY")])),
        no_proxy=",".join(filter(None, [HOST, env.get("no_proxy")])),
    )
    return env


def get_json(url: str, timeout: float = 10):
    with HTTP.open(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def tail(path: Path, chars: int = 12_000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "<no output>"


def stop(proc: subprocess.Popen, sigterms: int = 1, wait_s: float = 20) -> None:
    """SIGTERM `proc` by PID (a worker ignores the first one, so it gets two), then SIGKILL if needed."""
    for _ in range(sigterms):
        if proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            pass
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=wait_s)


@contextmanager
def prefect_server_at(tmp_path: Path, settings: dict[str, str] | None = None) -> Iterator[Server]:
    """A server started in `tmp_path`, with `settings` (PREFECT_* variables) on top of `server_env`'s."""
    port = free_port()
    api_url = f"http://{HOST}:{port}/api"
    (home := tmp_path / "prefect-home").mkdir()
    env = server_env(home, api_url) | (settings or {})
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
                pytest.fail(f"prefect server exited {proc.returncode}:\n{tail(log)}")
            try:
                if get_json(f"{api_url}/health", timeout=2) is True:
                    break
            except (OSError, ValueError):
                pass
            if time.monotonic() - t0 > HEALTH_TIMEOUT_S:
                pytest.fail(f"prefect server not healthy after {HEALTH_TIMEOUT_S} s:\n{tail(log)}")
            time.sleep(0.5)
        print(f"\nprefect server healthy on {api_url} after {time.monotonic() - t0:.1f} s")
        yield Server(api_url=api_url, env=env, log=log)
    finally:
        stop(proc, sigterms=1)


def run_cli(server: Server, argv: list, timeout: float = 300) -> str:
    """Run an executable (PREFECT, DRAFTSMITH) with args from the repository root against `server`; its output.

    Fails the test with the output when it exits non-zero.
    """
    res = subprocess.run(
        [str(a) for a in argv], cwd=ROOT, env=server.env, capture_output=True, text=True, timeout=timeout
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0, (
        f"`{Path(argv[0]).name} {' '.join(map(str, argv[1:4]))} ...` exited {res.returncode}:\n{out}"
    )
    return out


def deployable_copy(prefect_file: Path, tmp_path: Path) -> tuple[Path, list[str]]:
    """`prefect_file`, or a copy in `tmp_path` without the deployments whose entrypoint file does not exist yet.

    Returns the file to deploy and the names left out (a flow still being written elsewhere, e.g. the nightly).
    """
    import yaml

    doc = yaml.safe_load(prefect_file.read_text())
    missing = [d["name"] for d in doc["deployments"] if not (ROOT / d["entrypoint"].partition(":")[0]).is_file()]
    if not missing:
        return prefect_file, []
    doc["deployments"] = [d for d in doc["deployments"] if d["name"] not in missing]
    copy = tmp_path / prefect_file.name
    copy.write_text(yaml.safe_dump(doc, sort_keys=False))
    return copy, missing
