"""The torchrun launcher for real: 2 gloo ranks launched by torchrun, their lines streamed into the logger, a rank's
exception surfaced with its rank and traceback, a hung rank killed on timeout with no process left behind.
Plus the multi-node command line (c10d rendezvous from the env an Indexed Job gives each pod)."""

import base64
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from draftsmith.core.proctree import process_alive
from draftsmith.drafters.training.torchrun import (
    GRACE_S,
    TorchrunError,
    TorchrunSpec,
    TorchrunTimeout,
    fetch_launch,
    launch_address,
    run_torchrun,
    serve_launch,
    torchrun_command,
)

ROOT = Path(__file__).resolve().parents[2]
WORKER = "tests.integration.torchrun_worker_main"
LOGGER = "draftsmith.test.torchrun"
# The fixture worker is imported as `tests.integration...` from the repo root, wherever pytest runs.
ENV = {"PYTHONPATH": str(ROOT)}


def _spec(mode: str, **kw) -> TorchrunSpec:
    return TorchrunSpec(module=WORKER, args=["--mode", mode], nnodes=1, nproc_per_node=2, threads_per_rank=1, **kw)


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_two_ranks_all_reduce_and_stream_their_lines(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    t0 = time.monotonic()
    run_torchrun(_spec("ok", log_dir=str(tmp_path)), log=logging.getLogger(LOGGER), env=ENV, timeout_s=60)
    print(f"2-rank launch: {time.monotonic() - t0:.1f} s")
    lines = _lines(caplog)
    for rank in (0, 1):
        # torchrun's prefix carries the global rank; OMP_NUM_THREADS and DRAFTSMITH_THREADS reach each rank.
        assert any(
            re.fullmatch(rf"\[rank{rank}\]:worker rank={rank} world=2 pid=\d+ omp=1 threads=1", s) for s in lines
        )
        assert f"[rank{rank}]:all_reduce rank={rank} sum=3" in lines  # 1 + 2
    assert any("--standalone" in s and "--max-restarts 0" in s for s in lines if s.startswith("launching"))
    assert list(tmp_path.glob("*/attempt_0/1/stdout.log")), "torchrun --log-dir was not used"


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_failing_rank_is_named_with_its_traceback(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    with pytest.raises(TorchrunError) as info:
        run_torchrun(_spec("raise"), log=logging.getLogger(LOGGER), env=ENV, timeout_s=60)
    err = info.value
    assert not isinstance(err, TorchrunTimeout)
    assert err.rank == 1
    assert "rank 1 failed: ValueError: boom at rank 1" in str(err)
    # The traceback is the rank's own (from its @record error file), not rank 0's gloo error.
    assert "torchrun_worker_main.py" in err.traceback and "_fail_at_rank_1" in err.traceback
    assert "Connection closed by peer" not in err.traceback
    assert err.traceback in str(err)
    # The rank's stderr was streamed too, its traceback at DEBUG: the error above carries it, once.
    records = [r for r in caplog.records if r.name == LOGGER]
    boom = [
        r for r in records if r.getMessage().startswith("[rank1]:") and "ValueError: boom at rank 1" in r.getMessage()
    ]
    assert boom and all(r.levelno == logging.DEBUG for r in boom), [(r.levelname, r.getMessage()) for r in boom]
    assert not [r.getMessage() for r in records if r.levelno >= logging.INFO and "Traceback (most" in r.getMessage()]


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_timeout_kills_torchrun_and_every_rank(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    timeout_s = 10.0
    t0 = time.monotonic()
    with pytest.raises(TorchrunTimeout, match=r"still running after 10 s"):
        run_torchrun(_spec("hang"), log=logging.getLogger(LOGGER), env=ENV, timeout_s=timeout_s)
    elapsed = time.monotonic() - t0
    print(f"timeout {timeout_s:g} s -> raised after {elapsed:.1f} s")
    # Rank 1 ignores SIGTERM: only the SIGKILL after the grace period stops it.
    assert elapsed < timeout_s + 2 * GRACE_S + 3
    lines = _lines(caplog)
    rank_pids = [int(m.group(1)) for s in lines if (m := re.search(r"^\[rank\d\]:worker .* pid=(\d+)", s))]
    assert len(rank_pids) == 2, lines
    launcher = [int(m.group(1)) for s in lines if (m := re.match(r"stopping torchrun \(pid (\d+)\)", s))]
    assert len(launcher) == 1, lines
    survivors = [pid for pid in rank_pids + launcher if process_alive(pid)]
    assert not survivors, f"processes left running: {survivors}"


@pytest.mark.unit
def test_multi_node_command_uses_c10d_and_the_job_index() -> None:
    worker = "draftsmith.drafters.training.worker"
    spec = TorchrunSpec(module=worker, args=["--spec", "s.json"], nnodes=2, nproc_per_node=4,
                        threads_per_rank=8, log_dir="/tmp/logs")  # fmt: skip
    env = {"DRAFTSMITH_RDZV_ENDPOINT": "train-0.train:29400", "JOB_COMPLETION_INDEX": "1"}
    cmd = torchrun_command(spec, environ=env)
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert cmd[3:] == [
        "--nnodes", "2", "--nproc-per-node", "4",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "train-0.train:29400", "--rdzv-id", "draftsmith",
        "--rdzv-conf", "join_timeout=1800,is_host=false",
        "--max-restarts", "0", "--tee", "3", "--shutdown-timeout", "5", "--log-dir", "/tmp/logs",
        "-m", "draftsmith.drafters.training.worker", "--spec", "s.json",
    ]  # fmt: skip
    # Node 0 hosts the store; DRAFTSMITH_NODE_RANK wins over the job index; the spec wins over both.
    assert "join_timeout=1800,is_host=true" in torchrun_command(spec, environ=env | {"DRAFTSMITH_NODE_RANK": "0"})
    explicit = TorchrunSpec("m", [], 2, 4, 1, rdzv_endpoint="head:29400", node_rank=0)
    cmd = torchrun_command(explicit, environ=env)
    assert cmd[cmd.index("--rdzv-endpoint") + 1] == "head:29400" and "join_timeout=1800,is_host=true" in cmd
    # Without a node rank c10d's own hostname check picks the host.
    assert "join_timeout=1800" in torchrun_command(spec, environ={"DRAFTSMITH_RDZV_ENDPOINT": "h:1"})
    single = torchrun_command(TorchrunSpec("m", [], 1, 2, 1), environ=env)
    assert "--standalone" in single and "--rdzv-endpoint" not in single and "--log-dir" not in single


@pytest.mark.unit
def test_multi_node_command_errors_name_the_field() -> None:
    spec = TorchrunSpec("m", [], nnodes=2, nproc_per_node=4, threads_per_rank=1)
    with pytest.raises(ValueError, match=r"train\.distributed\.rdzv_endpoint.*DRAFTSMITH_RDZV_ENDPOINT"):
        torchrun_command(spec, environ={"JOB_COMPLETION_INDEX": "0"})
    ok = {"DRAFTSMITH_RDZV_ENDPOINT": "h:1"}
    with pytest.raises(ValueError, match=r"node rank 2 is outside 0\.\.1"):
        torchrun_command(spec, environ=ok | {"JOB_COMPLETION_INDEX": "2"})
    with pytest.raises(ValueError, match=r"JOB_COMPLETION_INDEX='x' is not an integer"):
        torchrun_command(spec, environ=ok | {"JOB_COMPLETION_INDEX": "x"})
    # The job template and the recipe disagree on the job's shape: fail now, not after the join timeout.
    with pytest.raises(ValueError, match=r"train\.distributed\.nnodes: the recipe says 2 but the job sets .*=3"):
        torchrun_command(spec, environ=ok | {"DRAFTSMITH_NNODES": "3"})
    with pytest.raises(ValueError, match=r"train\.distributed\.nproc_per_node: .* says 4 .*=2"):
        torchrun_command(spec, environ=ok | {"DRAFTSMITH_NPROC_PER_NODE": "2"})
    with pytest.raises(ValueError, match=r"TorchrunSpec\.threads_per_rank"):
        torchrun_command(TorchrunSpec("m", [], 1, 2, 0), environ={})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM then SIGKILL the follower's process group (it runs until its job ends it, by design)."""
    for sig, wait_s in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait_s)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_two_nodes_node0_serves_the_launch_to_a_follower(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    """Node 0 (as the flow's train task would) and a follower node (`python -m
    draftsmith.drafters.training.torchrun follow`, as
    pods
    1..n-1 of gb200-train run it) form one 2-rank job over a c10d rendezvous on loopback."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    rdzv, launch = f"127.0.0.1:{_free_port()}", str(_free_port())
    shared = tmp_path / "spec.json"
    shared.write_text('{"steps": 3}')
    follower_out = tmp_path / "follower.log"
    env = ENV | {"DRAFTSMITH_LAUNCH_PORT": launch, "DRAFTSMITH_NNODES": "2", "DRAFTSMITH_NPROC_PER_NODE": "1"}
    t0 = time.monotonic()
    with follower_out.open("w") as out:
        follower = subprocess.Popen(
            [sys.executable, "-m", "draftsmith.drafters.training.torchrun", "follow"],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
            env=os.environ | env | {"DRAFTSMITH_RDZV_ENDPOINT": rdzv, "JOB_COMPLETION_INDEX": "1"},
            start_new_session=True,
        )  # fmt: skip
    try:
        spec = TorchrunSpec(WORKER, ["--mode", "ok"], nnodes=2, nproc_per_node=1, threads_per_rank=1,
                            rdzv_endpoint=rdzv, node_rank=0, share_files=(str(shared),))  # fmt: skip
        run_torchrun(spec, log=logging.getLogger(LOGGER), env=env, timeout_s=60)
        print(f"2-node launch: {time.monotonic() - t0:.1f} s")
        # c10d numbers the nodes by (host name, agent pid), not by node index: either node may hold rank 0.
        here = [r for r in (0, 1) if f"[rank{r}]:all_reduce rank={r} sum=3" in _lines(caplog)]
        assert len(here) == 1, _lines(caplog)
        assert any("--rdzv-backend c10d" in s and "is_host=true" in s for s in _lines(caplog))
        other = 1 - here[0]
        deadline = time.monotonic() + 15
        while (
            f"[rank{other}]:all_reduce rank={other} sum=3" not in follower_out.read_text()
            and time.monotonic() < deadline
        ):
            time.sleep(0.2)
        text = follower_out.read_text()
        assert f"[rank{other}]:worker rank={other} world=2" in text, text
        assert f"[rank{other}]:all_reduce rank={other} sum=3" in text, text
        assert f"{WORKER} --mode ok (1 shared files)" in text and "is_host=false" in text, text
        # The follower outlives the launch, waiting for the next one (a retry of the task on node 0).
        time.sleep(1)
        assert follower.poll() is None, text
    finally:
        _stop(follower)


@pytest.mark.unit
def test_launch_payload_ships_shared_files(tmp_path: Path) -> None:
    shared = tmp_path / "nested" / "spec.json"
    shared.parent.mkdir()
    shared.write_bytes(b'{"lr": 0.001}\x00\xff')
    spec = TorchrunSpec("m", ["--spec", str(shared)], 2, 4, 8, rdzv_endpoint="127.0.0.1:1", share_files=(str(shared),))
    log = logging.getLogger(LOGGER)
    port = _free_port()
    environ = {"DRAFTSMITH_LAUNCH_PORT": str(port), "JOB_COMPLETION_INDEX": "0"}
    assert launch_address("head:29400", {}) == ("head", 29401)
    with serve_launch(spec, environ, log):
        first = fetch_launch("127.0.0.1", port, timeout_s=5)
    assert {k: first[k] for k in ("module", "args", "nnodes", "nproc_per_node", "threads_per_rank")} == {
        "module": "m", "args": ["--spec", str(shared)], "nnodes": 2, "nproc_per_node": 4, "threads_per_rank": 8,
    }  # fmt: skip
    assert base64.b64decode(first["files"][str(shared)]) == shared.read_bytes()
    # A second launch has a new id; asking past the one already run waits for it, and gives up when none comes.
    with serve_launch(spec, environ, log):
        second = fetch_launch("127.0.0.1", port, skip_id=first["launch_id"], timeout_s=5)
        assert second["launch_id"] != first["launch_id"]
        with pytest.raises(TimeoutError, match=rf"127\.0\.0\.1:{port} within 1 s"):
            fetch_launch("127.0.0.1", port, skip_id=second["launch_id"], timeout_s=1)
    # Node 1 does not serve.
    with serve_launch(spec, environ | {"JOB_COMPLETION_INDEX": "1"}, log):
        with pytest.raises(TimeoutError):
            fetch_launch("127.0.0.1", port, timeout_s=0.5)
