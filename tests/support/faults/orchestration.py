"""Orchestration faults on a real Prefect server with real process workers.

`killed_worker`: the select stage of the tiny recipe is dispatched to the `local-gpu` pool as a `stage/local-gpu`
flow run, whose prompt file is a FIFO nobody writes, so the stage is certainly mid-work (blocked reading its
input) when the worker that runs it is SIGKILLed with its process group and the flow run's own process (a
lost node takes both; Prefect's process worker starts the flow run in a session of its own). The dispatching
side, `dispatch.remote` in a process of its own, must call the run lost within `dispatch.lost_after_s` plus two
polls, mark it Crashed, and then fail in one line (`retries=0`) or dispatch the stage again, where a second,
live worker runs it to the end on the real prompt file: the manifest's files must be byte-equal to an
undisturbed run's, and exactly one flow run Completed. The same stage cancelled or deleted through the API, as
from the UI, must end the dispatching side at once with one line.

`two_runs_one_folder`: two `kimi-k3` deployment runs of one recipe and run folder on two workers; the second
must fail in one line naming the first before any stage of its own.

`gpu_slots_killed`: a process holding both slots of `gpu:local-gpu` through `draftsmith.core.gpus.gpu_slots`
is SIGKILLed while two more, each asking for both slots, wait; the slots must come back within the lease
(`SLOT_LEASE_S`) plus the server's repossessor loop (1 s here), both waiting holders must run, and no slot
may stay taken.
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from draftsmith.core import proctree
from tests.support.faults.result import FaultResult
from tests.support.paths import ROOT, TINY
from tests.support.prefect import (
    HEALTH_TIMEOUT_S,
    HOST,
    HTTP,
    PREFECT,
    Server,
    free_port,
    get_json,
    prefect_server_at,
    server_env,
    stop,
)

POOL = "local-gpu"
STAGE = "select_prompts"
HEARTBEAT_S, LOST_AFTER_S = 1.0, 6.0
# Workers poll every 15 s by default; the repossessor looks for expired slot leases every 15 s.
FAST = {
    "PREFECT_WORKER_QUERY_SECONDS": "1",
    "PREFECT_WORKER_PREFETCH_SECONDS": "1",
    "PREFECT_SERVER_SERVICES_REPOSSESSOR_LOOP_SECONDS": "1",
    # A run refused a slot is told to ask again after up to this many seconds (30 by default).
    "PREFECT_SERVER_CONCURRENCY_MAXIMUM_CONCURRENCY_SLOT_WAIT_SECONDS": "1",
}
# Where the server keeps concurrency leases: Prefect's default, in its memory, or in files under its home.
LEASE_STORAGE = {
    "memory": "prefect.server.concurrency.lease_storage.memory",
    "filesystem": "prefect.server.concurrency.lease_storage.filesystem",
}
PROMPTS = [{"prompt": f"Question {i}: what is {i} times {i + 7}?"} for i in range(30)]
WAIT_S = 240  # a guard against hangs: every wait below ends in seconds when things work

# The dispatching side: `dispatch.remote` for the select stage, reporting how it ended on its last line.
_PARENT = """
import json, sys
from draftsmith.core.config import PipelineConfig
from draftsmith.flows import dispatch
config = PipelineConfig.model_validate(json.loads(open(sys.argv[1]).read()))
try:
    manifest = dispatch.remote(config, "select_prompts", sys.argv[2], {}, sys.argv[3])
except dispatch.DispatchError as err:
    print("error: " + str(err), flush=True)
    sys.exit(3)
print("done " + manifest.key, flush=True)
"""
# Holds argv[1] slots of gpu:local-gpu for argv[2] seconds, saying when it has them.
_HOLD_SLOTS = """
import sys, time
from draftsmith.core.config import Resources
from draftsmith.core.gpus import gpu_slots
with gpu_slots(Resources(work_pool="local-gpu", gpus=int(sys.argv[1]))):
    print("held", time.time(), flush=True)
    time.sleep(float(sys.argv[2]))
print("released", flush=True)
"""


def _post(server: Server, path: str, body: dict) -> Any:
    req = urllib.request.Request(
        f"{server.api_url}/{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with HTTP.open(req, timeout=30) as resp:
        return json.loads(resp.read())


@contextmanager
def _client(server: Server) -> Iterator[Any]:
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: server.api_url}), get_client(sync_client=True) as client:
        yield client


def _deploy_stage_pool(server: Server, gpus: int) -> None:
    """The `local-gpu` process pool from its template, its `gpu:local-gpu` limit and `stage/local-gpu`, as
    `draftsmith deploy --local` makes them (without the other deployments, which only cost time here)."""
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, WorkPoolCreate

    from draftsmith.core.gpus import gpu_limit_name
    from draftsmith.pools import load_base_job_template

    with _client(server) as client:
        template = load_base_job_template(POOL)
        client.create_work_pool(WorkPoolCreate(name=POOL, type="process", base_job_template=template))
        client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=gpu_limit_name(POOL), limit=gpus))
        client.create_deployment(
            flow_id=client.create_flow_from_name("stage"),
            name=POOL,
            work_pool_name=POOL,
            entrypoint="flows/stages.py:stage_flow",
            pull_steps=[{"prefect.deployments.steps.set_working_directory": {"directory": str(ROOT)}}],
        )


def _active_slots(server: Server) -> int:
    return int(get_json(f"{server.api_url}/v2/concurrency_limits/gpu:{POOL}")["active_slots"])


def _worker(server: Server, log: Path) -> subprocess.Popen:
    with log.open("wb") as fh:
        return subprocess.Popen(
            [str(PREFECT), "worker", "start", "--pool", POOL, "--type", "process"],
            cwd=log.parent, env=server.env | FAST, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip


def _recipe(work: Path, prompts: Path, retries: int) -> dict:
    recipe = yaml.safe_load(TINY.read_text())
    recipe["select"] |= {"source": "jsonl", "path": str(prompts), "resources": {"work_pool": POOL}}
    recipe["dispatch"] = {"heartbeat_s": HEARTBEAT_S, "lost_after_s": LOST_AFTER_S, "retries": retries}
    return recipe


def _undisturbed(work: Path, recipe: dict) -> tuple[str, dict[str, str]]:
    """The stage key and `{file: digest}` of the select stage run without any fault, in this process."""
    from draftsmith.core.config import PipelineConfig
    from draftsmith.flows.stages import key_here
    from draftsmith.tasks.select_prompts import select_prompts

    config = PipelineConfig.model_validate(recipe)
    manifest = select_prompts(config.select, config.target, seed=config.seed, out_uri=str(work / "clean" / STAGE))
    return key_here(config, STAGE, {}), {f.name: f.digest for f in manifest.files}


def _stage_runs(server: Server) -> list[dict]:
    runs = _post(server, "flow_runs/filter", {"flow_runs": {"name": {"like_": STAGE}}})
    return sorted(runs, key=lambda r: r["created"])


def _wait_running(server: Server, run_dir: Path, parent: subprocess.Popen) -> dict:
    """The heartbeat of the dispatched stage once its flow run is Running and blocked on its input."""
    from draftsmith.core.heartbeat import read_beat

    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if parent.poll() is not None:
            raise RuntimeError(f"the dispatching process ended {parent.returncode} before the stage ran")
        beat = read_beat(str(run_dir), STAGE)
        runs = _stage_runs(server)
        if beat and runs and runs[-1]["state_type"] == "RUNNING" and beat["flow_run"] == runs[-1]["id"]:
            return beat
        time.sleep(0.5)
    raise TimeoutError(f"the dispatched stage was not Running within {WAIT_S} s")


def _parent_pid(pid: int) -> int:
    fields = proctree.stat_fields(pid)
    if fields is None:
        raise ProcessLookupError(pid)
    return int(fields[1])


def _kill_node(flow_pid: int, workers: tuple[int, ...] = ()) -> float:
    """SIGKILL the flow run's process group and, when it runs under one of `workers` (started by this module,
    each in a session of its own), the groups from it up to that worker, as a lost node would; when. Nothing
    else is touched: not this process's group, not an orphan's new parent."""
    groups, pid = [os.getpgid(flow_pid)], _parent_pid(flow_pid)
    chain: list[int] = []
    while pid > 1 and len(chain) < 4:
        chain.append(os.getpgid(pid))
        if pid in workers:
            groups += chain
            break
        pid = _parent_pid(pid)
    when = time.time()
    for group in dict.fromkeys(groups):
        if group != os.getpgrp():
            os.killpg(group, signal.SIGKILL)
    return when


FAULTS = {
    "kill": "worker killed mid-stage",
    "cancel": "dispatched run cancelled",
    "delete": "dispatched run deleted",
}


def killed_worker(workdir: str | Path | None = None, retries: int = 0, fault: str = "kill") -> FaultResult:
    """A dispatched stage mid-work, then `fault`: its worker and flow run SIGKILLed (`kill`), its flow run
    cancelled (`cancel`) or deleted (`delete`) through the API as from the UI; `retries` as `dispatch.retries`."""
    with tempfile.TemporaryDirectory(prefix="draftsmith-fault-") as tmp:
        work = Path(workdir) if workdir is not None else Path(tmp)
        with prefect_server_at(work, FAST) as server:
            return _dispatched_fault(server, work, retries, fault)


def _inject(server: Server, fault: str, beat: dict, workers: tuple[int, ...]) -> float:
    """The fault, on the Running stage whose heartbeat is `beat`; when."""
    if fault == "kill":
        return _kill_node(int(beat["pid"]), workers)
    when = time.time()
    if fault == "cancel":
        _post(server, f"flow_runs/{beat['flow_run']}/set_state", {"state": {"type": "CANCELLING"}, "force": True})
    else:
        req = urllib.request.Request(f"{server.api_url}/flow_runs/{beat['flow_run']}", method="DELETE")
        HTTP.open(req, timeout=30).close()
    return when


def _dispatched_fault(server: Server, work: Path, retries: int, fault: str) -> FaultResult:
    _deploy_stage_pool(server, gpus=1)
    prompts, run_dir = work / "prompts.jsonl", work / "run"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    recipe = _recipe(work, prompts, retries)
    key, clean = _undisturbed(work, recipe)
    (work / "recipe.json").write_text(json.dumps(recipe))
    real = prompts.with_suffix(".real")
    prompts.rename(real)
    os.mkfifo(prompts)  # the stage blocks reading it: certainly mid-work when the fault comes
    workers = [_worker(server, work / f"worker-{i}.log") for i in range(1 + (retries > 0))]
    argv = [sys.executable, "-c", _PARENT, str(work / "recipe.json"), str(run_dir), key]
    parent = subprocess.Popen(argv, cwd=ROOT, env=server.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    beat: dict = {}
    try:
        beat = _wait_running(server, run_dir, parent)
        injected_at = _inject(server, fault, beat, tuple(w.pid for w in workers))
        if fault == "kill":
            # A stage dispatched again reads the real file. A cancelled or deleted run's process is left on
            # the FIFO: one that is not stopped (deleted) would otherwise finish the stage after its parent.
            os.replace(real, prompts)
        out, err = parent.communicate(timeout=WAIT_S)
        ended_at = time.time()
    finally:
        for proc in [parent, *workers]:
            stop(proc, sigterms=2, wait_s=10)
        if beat and Path(f"/proc/{beat['pid']}").exists():  # a deleted run's process, left blocked on its input
            _kill_node(int(beat["pid"]))
    last = (out.strip().splitlines() or [""])[-1]
    runs = _stage_runs(server)
    crashed = [r for r in runs if r["state_type"] == "CRASHED"]
    completed = [r for r in runs if r["state_type"] == "COMPLETED"]
    if fault == "kill":  # when Prefect was told: the parent may go on to a retry
        detected = datetime.fromisoformat(crashed[0]["state"]["timestamp"]).timestamp() - injected_at if crashed else -1
    else:
        detected = ended_at - injected_at
    manifest = run_dir / STAGE / "manifest.json"
    files = {f["name"]: f["digest"] for f in json.loads(manifest.read_text())["files"]} if manifest.exists() else {}
    finished = bool(files) and last == f"done {key}"
    return FaultResult(
        fault="worker killed, stage retried" if retries else FAULTS[fault],
        units=1,
        # Reported in one line with nothing half-committed (a rerun resumes), or finished by the retry.
        lost=0 if (finished if retries else last.startswith("error: ") and not files) else 1,
        duplicated=max(0, len(completed) - 1),
        corrupted=sum(files.get(name) != digest for name, digest in clean.items()) if files else 0,
        injected=1,
        detected_within_s=detected,
        slots_leaked=_active_slots(server),
        detail={
            "exit": parent.returncode,
            "last_line": last,
            "stderr": err[-4000:],
            "states": [r["state_type"] for r in runs],
            "crashed_message": crashed[0]["state"]["message"] if crashed else None,
        },
    )


class _RestartableServer:
    """A Prefect server that can be SIGKILLed and started again on the same port and home (its database and,
    with the filesystem lease storage, its concurrency leases kept), as a redeployed server with a volume."""

    def __init__(self, work: Path, settings: dict[str, str]) -> None:
        api_url = f"http://{HOST}:{free_port()}/api"
        (home := work / "prefect-home").mkdir()
        self.server = Server(api_url=api_url, env=server_env(home, api_url) | settings, log=work / "server.log")
        self.proc: subprocess.Popen | None = None

    def start(self) -> float:
        """Start it and wait until it answers; the seconds that took."""
        port = self.server.api_url.rsplit(":", 1)[1].split("/")[0]
        argv = [str(PREFECT), "server", "start", "--host", HOST, "--port", port, "--no-ui"]
        with self.server.log.open("ab") as fh:
            self.proc = subprocess.Popen(
                argv, cwd=self.server.log.parent, env=self.server.env, stdout=fh, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        start = time.monotonic()
        while time.monotonic() - start < HEALTH_TIMEOUT_S:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prefect server exited {self.proc.returncode}; see {self.server.log}")
            try:
                if get_json(f"{self.server.api_url}/health", timeout=2) is True:
                    return time.monotonic() - start
            except (OSError, ValueError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"prefect server not healthy after {HEALTH_TIMEOUT_S} s; see {self.server.log}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _holder(server: Server, seconds: float) -> subprocess.Popen:
    argv = [sys.executable, "-c", _HOLD_SLOTS, "2", str(seconds)]
    return subprocess.Popen(argv, cwd=ROOT, env=server.env, stdout=subprocess.PIPE, text=True, start_new_session=True)


def gpu_slots_killed(
    workdir: str | Path | None = None, restart: bool = False, lease_storage: str = "filesystem"
) -> FaultResult:
    """A holder of both `gpu:local-gpu` slots SIGKILLed while two more runs wait for them; with `restart`, the
    server is SIGKILLed and started again first (its database kept, its leases kept by `lease_storage`)."""
    with tempfile.TemporaryDirectory(prefix="draftsmith-fault-") as tmp:
        work = Path(workdir) if workdir is not None else Path(tmp)
        settings = FAST | {"PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": LEASE_STORAGE[lease_storage]}
        restartable = _RestartableServer(work, settings)
        procs: list[subprocess.Popen] = []
        try:
            restartable.start()
            return _gpu_slots_killed(restartable, procs, restart, lease_storage)
        finally:
            for proc in procs:
                stop(proc)
            restartable.kill()


def _gpu_slots_killed(
    restartable: _RestartableServer, procs: list[subprocess.Popen], restart: bool, lease_storage: str
) -> FaultResult:
    from draftsmith.core.gpus import SLOT_LEASE_S

    server = restartable.server
    _deploy_stage_pool(server, gpus=2)
    procs.append(killed := _holder(server, 3600))
    assert killed.stdout is not None
    if not killed.stdout.readline().startswith("held"):
        raise RuntimeError("the first holder did not get its slots")
    time.sleep(2)  # past the renewal Prefect makes as the slots are taken: the next is 45 s away
    restart_s = 0.0
    if restart:
        restartable.kill()
        restart_s = restartable.start()
    held_by_killed = _active_slots(server)
    procs.extend(waiting := [_holder(server, 1), _holder(server, 1)])
    time.sleep(2)  # both are now asking, and waiting
    killed_at = time.time()
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    outs = []
    for proc in waiting:
        try:
            outs.append(proc.communicate(timeout=max(1.0, killed_at + SLOT_LEASE_S + 45 - time.time()))[0])
        except subprocess.TimeoutExpired:
            outs.append("")  # still waiting for slots that never came back
    got = sorted(float(line.split()[1]) for out in outs for line in out.splitlines() if line.startswith("held"))
    time.sleep(2)  # the last release reaches the server
    name = "server restart, holder killed" if restart else "GPU slot holder killed"
    return FaultResult(
        fault=name + (" (leases in memory)" if lease_storage == "memory" else ""),
        units=len(waiting),
        lost=len(waiting) - sum("released" in out for out in outs),
        injected=1 + restart,
        detected_within_s=(got[0] - killed_at) if got else -1.0,
        slots_leaked=_active_slots(server),
        detail={"held_by_killed": held_by_killed, "restart_s": restart_s, "outputs": outs},
    )


def two_runs_one_folder(workdir: str | Path | None = None) -> FaultResult:
    """Two `kimi-k3` deployment runs of one recipe and run folder at once, each taken by its own worker; the
    first to start blocks in its first stage (a FIFO for prompts). The other must fail in one line naming the
    holder before any stage of its own starts."""
    with tempfile.TemporaryDirectory(prefix="draftsmith-fault-") as tmp:
        work = Path(workdir) if workdir is not None else Path(tmp)
        with prefect_server_at(work, FAST) as server:
            return _two_runs_one_folder(server, work)


def _two_runs_one_folder(server: Server, work: Path) -> FaultResult:
    from prefect.client.schemas.actions import WorkPoolCreate

    from draftsmith.core.runlock import LOCK_NAME, read_holder
    from draftsmith.pools import load_base_job_template

    prompts, run_dir = work / "prompts.jsonl", work / "run"
    os.mkfifo(prompts)
    recipe = yaml.safe_load(TINY.read_text())
    recipe["select"] |= {"source": "jsonl", "path": str(prompts)}
    with _client(server) as client:
        client.create_work_pool(
            WorkPoolCreate(name="local", type="process", base_job_template=load_base_job_template("local"))
        )
        deployment = client.create_deployment(
            flow_id=client.create_flow_from_name("kimi-k3"), name="faults", work_pool_name="local",
            entrypoint="flows/pipeline.py:kimi_k3",
            pull_steps=[{"prefect.deployments.steps.set_working_directory": {"directory": str(ROOT)}}],
        )  # fmt: skip
        params = {"config": recipe, "run_dir": str(run_dir)}
        runs = [client.create_flow_run_from_deployment(deployment, parameters=params) for _ in range(2)]
    workers = [
        subprocess.Popen(
            [str(PREFECT), "worker", "start", "--pool", "local", "--type", "process", "--limit", "1"],
            cwd=work,
            env=server.env | FAST,
            stdout=(work / f"w{i}.log").open("wb"),
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        for i in range(2)
    ]
    holder: dict = {}
    try:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            states = {str(r.id): get_json(f"{server.api_url}/flow_runs/{r.id}")["state"] for r in runs}
            holder = read_holder(run_dir / LOCK_NAME) or {}
            failed = [(i, st) for i, st in states.items() if st and st["type"] in ("FAILED", "CRASHED")]
            if failed and holder:
                break
            time.sleep(1)
        else:
            raise TimeoutError(f"no run was refused within {WAIT_S} s: {states}")
    finally:
        for proc in workers:
            stop(proc, sigterms=2, wait_s=10)
        if holder.get("pid") and Path(f"/proc/{holder['pid']}").exists():
            _kill_node(int(holder["pid"]))  # the holder, blocked on its input for good
    (refused_id, refused), message = failed[0], failed[0][1]["message"] or ""
    started = get_json(f"{server.api_url}/flow_runs/{refused_id}")["start_time"]
    took = datetime.fromisoformat(refused["timestamp"]).timestamp() - datetime.fromisoformat(started).timestamp()
    stages = _post(server, "task_runs/filter", {"flow_runs": {"id": {"any_": [refused_id]}}})
    return FaultResult(
        fault="two runs of one run folder",
        units=1,
        duplicated=len(stages),  # stages the refused run started
        injected=1,
        detected_within_s=took,
        detail={"message": message, "holder": holder, "refused_state": refused["type"], "stages": len(stages)},
    )


SCENARIOS = {
    "killed-worker": killed_worker,
    "killed-worker-retry": lambda workdir=None: killed_worker(workdir, retries=1),
    "cancelled-stage-run": lambda workdir=None: killed_worker(workdir, fault="cancel"),
    "deleted-stage-run": lambda workdir=None: killed_worker(workdir, fault="delete"),
    "gpu-slot-holder-killed": gpu_slots_killed,
    # With leases kept on disk; Prefect's default (memory) leaks the slots (docs/orchestration.md), so it is
    # measured with `gpu_slots_killed(restart=True, lease_storage="memory")`, not repeated here.
    "server-restart-slot-holder-killed": lambda workdir=None: gpu_slots_killed(workdir, restart=True),
    "two-runs-one-folder": two_runs_one_folder,
}
