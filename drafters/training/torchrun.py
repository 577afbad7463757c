"""Launch a Python module on every rank through torchrun, stream its output, fail with the failing rank's traceback.

One `run_torchrun` call is one node's launch: `--standalone` on one node; on N nodes a c10d rendezvous at
`rdzv_endpoint` (or `$DRAFTSMITH_RDZV_ENDPOINT`, which the gb200-train job template sets), node 0 hosting it.
Workers should wrap their entry point in torch.distributed.elastic's `@record`: its per-rank `error.json`
(under `--log-dir`) is where the failing rank's traceback is read from; `drafters.training.rank_health` names the rank
that caused a failure and kills a launch whose rank went silent past its bound.

Only node 0 of a multi-node job runs the Prefect flow; it serves each launch to the other nodes, which run
`python -m draftsmith.drafters.training.torchrun follow` (deployments/work-pools/README.md, gb200-train).
"""

import argparse
import base64
import contextlib
import ipaddress
import json
import logging
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from draftsmith.core import procs, proctree, runlock
from draftsmith.core.proctree import process_alive
from draftsmith.drafters.training import rank_health
from draftsmith.drafters.training.rank_health import HEARTBEAT_ENV, TorchrunError, TorchrunTimeout

RDZV_ENDPOINT_ENV = "DRAFTSMITH_RDZV_ENDPOINT"
# JOB_COMPLETION_INDEX is what a Kubernetes Indexed Job gives each pod.
NODE_RANK_ENVS = ("DRAFTSMITH_NODE_RANK", "JOB_COMPLETION_INDEX")
NNODES_ENV = "DRAFTSMITH_NNODES"
NPROC_PER_NODE_ENV = "DRAFTSMITH_NPROC_PER_NODE"
THREADS_ENV = "DRAFTSMITH_THREADS"
LAUNCH_PORT_ENV = "DRAFTSMITH_LAUNCH_PORT"
# torchrun prefixes every teed rank line with this (global rank), so interleaved lines stay attributable.
RANK_PREFIX_TEMPLATE = "[rank${rank}]:"
# Seconds between SIGTERM and SIGKILL, for torchrun's own worker shutdown and for ours.
GRACE_S = 5.0
# Nodes of a multi-node job start minutes apart (image pulls on fresh nodes); wait that long for all to join.
JOIN_TIMEOUT_S = 1800
_TAIL_LINES = 400


@dataclass(frozen=True)
class TorchrunSpec:
    """One node's launch of `python -m module *args` on `nproc_per_node` ranks (of `nnodes` nodes)."""

    module: str
    args: list[str]
    nnodes: int
    nproc_per_node: int
    threads_per_rank: int
    rdzv_endpoint: str | None = None
    rdzv_id: str = "draftsmith"
    node_rank: int | None = None
    log_dir: str | None = None  # torchrun --log-dir; run_torchrun defaults it to a temp dir
    # Files the other nodes need at the same path (e.g. the worker's --spec file); node 0 ships them.
    share_files: tuple[str, ...] = ()


def _env_int(environ: Mapping[str, str], name: str, field: str) -> int | None:
    raw = environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{field}: environment variable {name}={raw!r} is not an integer") from None


def _check_job_shape(spec: TorchrunSpec, environ: Mapping[str, str]) -> None:
    """A job template that disagrees with the recipe would leave the rendezvous waiting for nodes that never come."""
    for env, field, want in (
        (NNODES_ENV, "train.distributed.nnodes", spec.nnodes),
        (NPROC_PER_NODE_ENV, "train.distributed.nproc_per_node", spec.nproc_per_node),
    ):
        got = _env_int(environ, env, field)
        if got is not None and got != want:
            raise ValueError(f"{field}: the recipe says {want} but the job sets {env}={got}; make them agree")


def resolve_rendezvous(spec: TorchrunSpec, environ: Mapping[str, str]) -> tuple[str, int | None]:
    """(`host:port`, node rank or None) of a multi-node launch: the spec's values, else the job's env."""
    endpoint = spec.rdzv_endpoint or environ.get(RDZV_ENDPOINT_ENV)
    if not endpoint:
        raise ValueError(
            f"train.distributed.rdzv_endpoint: a {spec.nnodes}-node launch needs a c10d rendezvous `host:port`; "
            f"set it in the recipe or run on a pool whose job sets {RDZV_ENDPOINT_ENV} (e.g. gb200-train)"
        )
    if ":" not in endpoint or not endpoint.rsplit(":", 1)[1].isdigit():
        raise ValueError(f"train.distributed.rdzv_endpoint: {endpoint!r} is not `host:port`")
    node_rank = spec.node_rank
    for name in NODE_RANK_ENVS:
        if node_rank is None:
            node_rank = _env_int(environ, name, "node rank")
    if node_rank is not None and not 0 <= node_rank < spec.nnodes:
        raise ValueError(f"node rank {node_rank} is outside 0..{spec.nnodes - 1} (train.distributed.nnodes)")
    return endpoint, node_rank


def _rendezvous_args(spec: TorchrunSpec, environ: Mapping[str, str]) -> list[str]:
    if spec.nnodes == 1:
        return ["--standalone"]
    endpoint, node_rank = resolve_rendezvous(spec, environ)
    conf = f"join_timeout={JOIN_TIMEOUT_S}"
    if node_rank is not None:
        # c10d ignores --node-rank; what it needs is which node hosts the store. Saying so beats its
        # hostname/IP heuristic, which pod DNS names do not always satisfy.
        conf += f",is_host={'true' if node_rank == 0 else 'false'}"
    return ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", spec.rdzv_id, "--rdzv-conf", conf]


def torchrun_command(spec: TorchrunSpec, *, environ: Mapping[str, str] | None = None) -> list[str]:
    """`[python, -m, torch.distributed.run, ...]` for `spec`; `environ` (default os.environ) supplies the
    rendezvous endpoint and node rank a multi-node job template sets."""
    environ = os.environ if environ is None else environ
    for field in ("nnodes", "nproc_per_node", "threads_per_rank"):
        if getattr(spec, field) < 1:
            raise ValueError(f"TorchrunSpec.{field}: must be >= 1, got {getattr(spec, field)}")
    _check_job_shape(spec, environ)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(spec.nnodes)]
    cmd += ["--nproc-per-node", str(spec.nproc_per_node), *_rendezvous_args(spec, environ)]
    # Prefect retries the task and the trainer resumes from its checkpoint: torchrun must not restart ranks.
    cmd += ["--max-restarts", "0", "--tee", "3", "--shutdown-timeout", str(int(GRACE_S))]
    if spec.log_dir is not None:
        cmd += ["--log-dir", spec.log_dir]
    return cmd + ["-m", spec.module, *spec.args]


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_launch(proc: subprocess.Popen, log: logging.Logger | logging.LoggerAdapter) -> None:
    """SIGTERM torchrun's group (torchrun forwards it to the ranks), then SIGKILL torchrun and every rank.

    Ranks run in their own sessions (torchrun starts each with start_new_session), so they are found by
    walking /proc before torchrun goes, and each rank's group is killed too.
    """
    ranks = proctree.descendants(proc.pid)
    log.warning("stopping torchrun (pid %d) and %d descendant processes", proc.pid, len(ranks))
    _signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=GRACE_S + 1)
    except subprocess.TimeoutExpired:
        pass
    for pgid in [proc.pid, *ranks]:
        _signal_group(pgid, signal.SIGKILL)
    for pid in ranks:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()
    deadline = time.monotonic() + GRACE_S
    while any(process_alive(p) for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)


def _child_env(spec: TorchrunSpec, env: Mapping[str, str] | None) -> dict[str, str]:
    threads = str(spec.threads_per_rank)
    return {
        **os.environ,
        **(env or {}),
        "OMP_NUM_THREADS": threads,
        THREADS_ENV: threads,
        "PYTHONUNBUFFERED": "1",  # rank lines reach the log as they are printed, not at exit
        "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": RANK_PREFIX_TEMPLATE,
    }


def _stream(proc: subprocess.Popen, log: logging.Logger | logging.LoggerAdapter, tail: deque) -> None:
    """Log every output line; traceback lines at DEBUG: the failure's error carries the cause's own."""
    assert proc.stdout is not None
    tracebacks = rank_health.TracebackLines()
    for raw in proc.stdout:
        line = raw.rstrip("\n")
        tail.append(line)
        log.log(logging.DEBUG if tracebacks.within(line) else logging.INFO, "%s", line)


def _supervise(
    spec: TorchrunSpec, cmd: list[str], child_env: dict[str, str], log: logging.Logger | logging.LoggerAdapter,
    timeout_s: float | None,
) -> None:  # fmt: skip
    since_ns = time.time_ns() - 1_000_000_000  # mtime granularity slack
    tail: deque[str] = deque(maxlen=_TAIL_LINES)
    # torchrun dies with us (this thread waits for it) and holds the run folder's lock while it lives, so a
    # rerun cannot start while a trainer of a killed run still writes. The ranks arm their own death signal.
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=child_env, text=True, errors="replace",
        pass_fds=runlock.inherited_fds(), **procs.popen_kwargs(caller_waits=True),
    )  # fmt: skip
    reader = threading.Thread(target=_stream, args=(proc, log, tail), name="torchrun-log", daemon=True)
    reader.start()
    try:
        try:
            rc = rank_health.wait_watching(proc, timeout_s, Path(child_env[HEARTBEAT_ENV]))
        except rank_health.Stalled as stalled:
            for beat, _, _ in stalled.args[0]:  # a stopped rank cannot act on torchrun's SIGTERM: do not wait for it
                with contextlib.suppress(OSError):
                    os.kill(beat["pid"], signal.SIGKILL)
            _kill_launch(proc, log)
            raise rank_health.stall_error(spec.module, stalled, list(tail)) from None
        except subprocess.TimeoutExpired:
            _kill_launch(proc, log)
            raise TorchrunTimeout(
                f"torchrun {spec.module}: still running after {timeout_s:g} s; killed it and its ranks",
                rank=None,
                traceback="\n".join(list(tail)[-20:]),
            ) from None
        except BaseException:
            _kill_launch(proc, log)
            raise
    finally:
        reader.join(timeout=GRACE_S)
    if rc != 0:
        raise rank_health.failure(spec.module, spec.log_dir, spec.nnodes, rc, list(tail), since_ns)


def run_torchrun(
    spec: TorchrunSpec,
    *,
    log: logging.Logger | logging.LoggerAdapter,
    env: dict[str, str] | None = None,
    timeout_s: float | None = None,
) -> None:
    """Run `spec` to completion, logging every output line as it arrives.

    `env` is merged over os.environ. Raises TorchrunError (first failing rank and its traceback) on a
    non-zero exit, TorchrunTimeout after `timeout_s`; on a timeout or any exception (KeyboardInterrupt
    included) torchrun and all its ranks are killed before this returns. On node 0 of a multi-node job the
    launch is also served to `python -m draftsmith.drafters.training.torchrun follow` on the other nodes while it runs.
    """
    own_log_dir = spec.log_dir is None
    if own_log_dir:
        spec = replace(spec, log_dir=tempfile.mkdtemp(prefix="draftsmith-torchrun-"))
    try:
        child_env = _child_env(spec, env)
        # Per launch, so that a rerun never reads a heartbeat of the launch before it.
        child_env[HEARTBEAT_ENV] = tempfile.mkdtemp(prefix="heartbeat-", dir=spec.log_dir)
        cmd = torchrun_command(spec, environ=child_env)
        with serve_launch(spec, child_env, log):
            log.info("launching %s", " ".join(cmd))
            _supervise(spec, cmd, child_env, log, timeout_s)
        log.info("torchrun %s: all %d ranks of this node finished", spec.module, spec.nproc_per_node)
    finally:
        if own_log_dir and spec.log_dir is not None:
            shutil.rmtree(spec.log_dir, ignore_errors=True)


# --- other nodes of a multi-node job ------------------------------------------------------------------------
# Only pod 0 of a gb200-train job runs the flow; pods 1..n-1 run
# `python -m draftsmith.drafters.training.torchrun follow`, which fetches each launch (module, args, shared
# files) from node 0 and runs this node's torchrun for it.


def launch_address(endpoint: str, environ: Mapping[str, str]) -> tuple[str, int]:
    """Where node 0 serves its launches: the rendezvous host, port `$DRAFTSMITH_LAUNCH_PORT` or rdzv port + 1."""
    host, port = endpoint.rsplit(":", 1)
    return host, _env_int(environ, LAUNCH_PORT_ENV, "launch port") or int(port) + 1


def launch_payload(spec: TorchrunSpec) -> bytes:
    """JSON of what the other nodes need to run `spec`: a fresh launch id, the module, args and shared files."""
    files = {path: base64.b64encode(Path(path).read_bytes()).decode() for path in spec.share_files}
    fields = ("module", "args", "nnodes", "nproc_per_node", "threads_per_rank", "rdzv_id")
    return json.dumps({"launch_id": uuid.uuid4().hex, "files": files} | {f: getattr(spec, f) for f in fields}).encode()


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


@contextlib.contextmanager
def serve_launch(
    spec: TorchrunSpec, environ: Mapping[str, str], log: logging.Logger | logging.LoggerAdapter
) -> Iterator[None]:
    """On node 0 of a multi-node launch, answer every connection with `launch_payload(spec)` while the block runs."""
    if spec.nnodes == 1 or resolve_rendezvous(spec, environ)[1] != 0:
        yield
        return
    host, port = launch_address(resolve_rendezvous(spec, environ)[0], environ)
    payload = launch_payload(spec)
    # The other pods connect over the pod network; a loopback endpoint (tests) stays on loopback.
    server = socket.create_server((host if _is_loopback(host) else "", port))
    server.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.sendall(struct.pack("!Q", len(payload)) + payload)

    thread = threading.Thread(target=serve, name="torchrun-launch", daemon=True)
    thread.start()
    log.info("serving this launch to nodes 1..%d on port %d", spec.nnodes - 1, port)
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=2)
        server.close()


def fetch_launch(host: str, port: int, *, skip_id: str | None = None, timeout_s: float | None = None) -> dict:
    """The next launch node 0 serves whose id is not `skip_id`; retries while node 0 is not serving one."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=10) as conn:
                data = b""
                while chunk := conn.recv(1 << 20):
                    data += chunk
            (size,) = struct.unpack("!Q", data[:8])
            launch = json.loads(data[8 : 8 + size])
            if launch["launch_id"] != skip_id:
                return launch
        except (OSError, struct.error, ValueError):
            pass  # not serving yet (refused, DNS not published, torn read)
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"no launch from node 0 at {host}:{port} within {timeout_s:g} s")
        time.sleep(1.0)


def follow(*, environ: Mapping[str, str] | None = None, log: logging.Logger, timeout_s: float | None = None) -> None:
    """Run node 0's launches on this node, forever: a Prefect task retry on node 0 is a new launch.

    The job ends the follower (gb200-train: its success policy when pod 0 succeeds, `backoffLimit` 0 when
    pod 0 fails); a failed launch is logged and the follower waits for the next one.
    """
    environ = os.environ if environ is None else environ
    endpoint = environ.get(RDZV_ENDPOINT_ENV)
    if not endpoint:
        raise ValueError(
            f"draftsmith.drafters.training.torchrun follow: {RDZV_ENDPOINT_ENV} is not set (the job template sets it)"
        )
    host, port = launch_address(endpoint, environ)
    last = None
    while True:
        launch = fetch_launch(host, port, skip_id=last, timeout_s=timeout_s)
        last = launch["launch_id"]
        for path, data in launch["files"].items():
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_bytes(base64.b64decode(data))
        fields = ("module", "args", "nnodes", "nproc_per_node", "threads_per_rank", "rdzv_id")
        spec = TorchrunSpec(**{f: launch[f] for f in fields}, rdzv_endpoint=endpoint)
        if resolve_rendezvous(spec, environ)[1] == 0:
            raise ValueError(
                "draftsmith.drafters.training.torchrun follow: this is node 0, which runs the flow "
                "(and serves launches)"
            )
        log.info("launch %s: %s %s (%d shared files)", last, spec.module, " ".join(spec.args), len(launch["files"]))
        try:
            run_torchrun(spec, log=log, env=dict(environ))
        except TorchrunError as exc:
            log.error("launch %s failed on this node: %s", last, exc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m draftsmith.drafters.training.torchrun", description=__doc__.splitlines()[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    cmd = sub.add_parser("follow", help="run node 0's torchrun launches on this node (nodes 1..n-1)")
    cmd.add_argument("--timeout-s", type=float, default=None, help="give up waiting for a launch after this")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(asctime)s %(message)s")
    log = logging.getLogger("draftsmith.torchrun.follow")
    try:
        follow(log=log, timeout_s=args.timeout_s)
    except (TimeoutError, ValueError) as exc:
        log.error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
