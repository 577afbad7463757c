"""Fault scenarios of training, shared by `benchmarks/faults.py` and `tests/faults`: the Mooncake master
SIGKILLed in the middle of online training, one of two gloo ranks SIGKILLed or stopped (SIGSTOP) for longer
than `train.distributed.timeout_s`, and the process holding the online stream SIGKILLed.

Each runs the real processes (`mooncake_master`, torchrun and its ranks, the producer processes) on the
tiny recipe and returns a `FaultResult`. For training faults the units are the checkpoints committed before
the fault (and, where the run is rerun, its optimizer steps): `lost` counts checkpoints gone afterwards and
steps the rerun never recorded, `duplicated` steps recorded twice, `corrupted` checkpoints whose bytes
changed or that no longer load. For the killed parent the units are the processes it started, and every
one still running after `DEATH_S` counts as `duplicated`: a rerun would start its own beside it.
`detected_within_s` is the time from the fault to the error (or to the last child's death).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from draftsmith.core import proctree
from tests.support.faults.result import FaultResult
from tests.support.paths import ROOT, TINY

STALL_S = 10  # train.distributed.timeout_s of the rank scenarios: its minimum
MASTER_TIMEOUT_S = 10.0  # hidden_states.online.master_timeout_s of the master scenario
DEATH_S = 5.0  # how long the children of a SIGKILLed parent may take to die
_BUILT: dict[str, tuple] = {}


def tiny_inputs(workdir: str | Path | None = None) -> tuple:
    """The tiny recipe and its stages up to the hidden-state store: `(config, {stage: manifest})`, once per folder."""
    from draftsmith.core.config import load_recipe
    from draftsmith.tasks.hidden_states import capture_hidden_states
    from draftsmith.tasks.regenerate import regenerate
    from draftsmith.tasks.select_prompts import select_prompts
    from draftsmith.tasks.tokenization import tokenize

    if str(workdir) in _BUILT:
        return _BUILT[str(workdir)]
    if workdir is None:
        root = Path(tempfile.mkdtemp(prefix="draftsmith-fault-stream-"))
        atexit.register(shutil.rmtree, root, True)
    else:
        root = Path(workdir)
    c = load_recipe(TINY)
    run = {"select_prompts": select_prompts(c.select, c.target, seed=c.seed, out_uri=str(root / "select_prompts"))}
    run["regenerate"] = regenerate(
        c.regenerate, c.target, run["select_prompts"], seed=c.seed, out_uri=str(root / "regen")
    )
    run["tokenize"] = tokenize(c.tokenize, c.target, run["regenerate"], out_uri=str(root / "tokenize"))
    run["hidden_states"] = capture_hidden_states(c.hidden_states, c.target, run["tokenize"], out_uri=str(root / "hs"))
    _BUILT[str(workdir)] = (c, run)
    return c, run


# --- processes ------------------------------------------------------------------------------------------------


def cmdline(pid: int) -> bytes | None:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None


def descendants(match: str, env: str | None = None) -> list[int]:
    """This process's live descendants whose command line holds `match` (and whose environment holds `env`)."""
    found = []
    for pid in proctree.descendants(os.getpid()):
        if match.encode() not in (cmdline(pid) or b"").replace(b"\0", b" ") or not proctree.process_alive(pid):
            continue
        with contextlib.suppress(OSError):
            if env is None or env.encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                found.append(pid)
    return found


def _rank_pid(rank: int) -> int | None:
    ranks = [p for p in descendants("-m draftsmith.drafters.training.worker", f"RANK={rank}") if _is_python_worker(p)]
    return ranks[0] if ranks else None


def _is_python_worker(pid: int) -> bool:
    # torchrun's own command line names the worker module too.
    return b"torch.distributed.run" not in (cmdline(pid) or b"torch.distributed.run")


def _release(pid: int | None, argv: bytes | None) -> None:
    """Never leave a stopped or injected process behind, whatever the scenario's outcome; `argv` (its command
    line when it was faulted) makes sure the pid was not reused by another process since."""
    if pid is None or not proctree.process_alive(pid) or cmdline(pid) != argv:
        return
    for sig in (signal.SIGCONT, signal.SIGKILL):
        with contextlib.suppress(OSError):
            os.kill(pid, sig)


# --- checkpoints ----------------------------------------------------------------------------------------------


def committed(stage: Path) -> dict[str, dict[str, str]]:
    """The complete checkpoints of a train stage folder: `{folder: {file: sha256}}`."""
    out = {}
    for marker in sorted(stage.glob("checkpoints/step-*/trainer.json")):
        folder = marker.parent
        out[folder.name] = {
            str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*"))
            if p.is_file()
        }
    return out


def loads(folder: Path) -> bool:
    """Whether every tensor of the DCP checkpoint in `folder` reads back (through the trainer's safe reader)."""
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from draftsmith.drafters.training.checkpoint import load_dcp, read_dcp_metadata

    try:
        meta = read_dcp_metadata((folder / ".metadata").read_bytes(), str(folder))
        state = {
            k: torch.zeros(m.size, dtype=m.properties.dtype)
            for k, m in meta.state_dict_metadata.items()
            if isinstance(m, TensorStorageMetadata)
        }
        with warnings_off():
            load_dcp(state, str(folder))
        json.loads((folder / "trainer.json").read_text())
    except Exception:  # any failure to read back is what is being counted
        return False
    return bool(state)


@contextlib.contextmanager
def warnings_off():
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def damaged(stage: Path, before: dict[str, dict[str, str]]) -> tuple[int, int]:
    """(checkpoints of `before` now gone, those whose bytes changed or that no longer load)."""
    now = committed(stage)
    gone = [name for name in before if name not in now]
    bad = [
        name
        for name in before
        if name in now and (now[name] != before[name] or not loads(stage / "checkpoints" / name))
    ]
    return len(gone), len(bad)


def inject_after_checkpoint(stage: Path, target, sig: signal.Signals, state: dict, wait_s: float = 300.0) -> None:
    """Once a checkpoint is complete in `stage`, record the committed ones and send `sig` to `target()`'s pid.

    Runs on a thread beside the training call; `state` gets `committed`, `pid` and `t` (monotonic time).
    """
    deadline = time.monotonic() + wait_s
    while not list(stage.glob("checkpoints/step-*/trainer.json")):
        if time.monotonic() > deadline:
            return
        time.sleep(0.05)
    pid = target()
    if pid is None:
        return
    state["committed"], state["argv"] = committed(stage), cmdline(pid)
    os.kill(pid, sig)
    state["pid"], state["t"] = pid, time.monotonic()


class _Collect(logging.Handler):
    def __init__(self, lines: list[str]) -> None:
        super().__init__(logging.INFO)
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def lines_of(logger_name: str):
    """Every message `logger_name` logs inside the block, whatever the logging configuration (faults.py
    disables INFO), without printing them."""
    logger, lines = logging.getLogger(logger_name), list[str]()
    handler = _Collect(lines)
    old = (logger.level, logger.propagate, logging.root.manager.disable)
    logging.disable(logging.NOTSET)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old[0])
        logger.propagate = old[1]
        logging.disable(old[2])


# --- scenarios ------------------------------------------------------------------------------------------------


def _run_train(c, run, stage: Path, train_cfg, hidden_cfg, *, offline: bool):
    from draftsmith.tasks.train import train

    hidden = run["hidden_states"] if offline else None
    return train(
        train_cfg, c.drafter, c.target, hidden_cfg, run["tokenize"], hidden, seed=c.seed, out_uri=str(stage)
    )  # fmt: skip


def _with(model, **fields):
    """`model` with `fields` replaced; a dict value updates that sub-model's fields."""
    plain = {k: v for k, v in fields.items() if not isinstance(v, dict)}
    nested = {k: getattr(model, k).model_copy(update=v) for k, v in fields.items() if isinstance(v, dict)}
    return model.model_copy(update=plain | nested)


def _faulted_run(c, run, stage: Path, train_cfg, hidden_cfg, target, sig, *, offline: bool) -> dict:
    """Train until a checkpoint is complete, fault `target()` with `sig`, and wait for the run to fail.

    Returns the injection record plus `error` (the exception, None if the run finished) and `detected`
    (seconds from the fault to the error).
    """
    state: dict = {}
    thread = threading.Thread(target=inject_after_checkpoint, args=(stage, target, sig, state), daemon=True)
    thread.start()
    try:
        _run_train(c, run, stage, train_cfg, hidden_cfg, offline=offline)
        state["error"] = None
    except Exception as exc:  # what a fault turns into is what is being measured
        state["error"] = exc
    finally:
        state["detected"] = time.monotonic() - state["t"] if "t" in state else float("nan")
        _release(state.get("pid"), state.get("argv"))
        thread.join(timeout=5)
    return state


def rank_lost(how: str = "killed", workdir: str | Path | None = None, *, run: tuple | None = None) -> FaultResult:
    """2 gloo ranks train the tiny drafter with a checkpoint every 2 steps; once one is complete, rank 1 is
    SIGKILLed (`killed`) or stopped with SIGSTOP for good (`stopped`). Then the run is rerun to the end.

    `detail`: the error text, the rank it names, `resumed_at` (the rerun's first step), `newest` (the newest
    checkpoint committed when the run failed), `survivors` (rank processes left) and `steps`.
    """
    c, inputs = run or tiny_inputs()
    with tempfile.TemporaryDirectory(prefix="draftsmith-fault-") as tmp:
        stage = Path(workdir or tmp) / f"train-{how}"
        cfg = _with(
            c.train, epochs=6, batch_tokens=256, checkpoint={"every_steps": 2, "keep": 2},
            distributed={"nproc_per_node": 2, "timeout_s": STALL_S}, resources={"cpus": 2},
        )  # fmt: skip
        sig = signal.SIGKILL if how == "killed" else signal.SIGSTOP
        state = _faulted_run(c, inputs, stage, cfg, c.hidden_states, lambda: _rank_pid(1), sig, offline=True)
        survivors = descendants("-m draftsmith.drafters.training.worker")
        newest = max((int(n.split("-")[1]) for n in committed(stage)), default=0)
        gone, bad = damaged(stage, state.get("committed", {}))
        with lines_of("draftsmith.train") as lines:
            manifest = _run_train(c, inputs, stage, cfg, c.hidden_states, offline=True)
        starts = [int(m[1]) for line in lines if (m := re.search(r"resuming at step (\d+)", line))]
        seen = Counter(json.loads(x)["step"] for x in (stage / "metrics.jsonl").read_text().splitlines() if x.strip())
        steps = manifest.counts["steps"]
        error = state["error"]
        return FaultResult(
            fault=f"one of 2 ranks {how}",
            units=len(state.get("committed", {})) + steps,
            lost=gone + sum(1 for s in range(1, steps + 1) if not seen[s]),
            duplicated=sum(n - 1 for n in seen.values() if n > 1),
            corrupted=bad + int(starts[:1] != [newest]),
            injected=int("t" in state),
            detected_within_s=state["detected"],
            detail={
                "error": None if error is None else str(error),
                "rank": getattr(error, "rank", None),
                "resumed_at": starts[0] if starts else None,
                "newest": newest,
                "survivors": survivors,
                "steps": steps,
            },
        )


def _master_addr(pid: int) -> str:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    flags = dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)
    return f"{flags['rpc_address']}:{flags['rpc_port']}"


def master_killed(workdir: str | Path | None = None, *, run: tuple | None = None) -> FaultResult:
    """Online training of the tiny drafter, the stage starting its own `mooncake_master` and one producer;
    once a checkpoint is complete the master is SIGKILLed. The producer runs ahead of the trainer (40 epochs
    into a 16 MiB segment, Mooncake's smallest), so announced samples wait unread and it is itself held by
    back-pressure when the master goes.

    `detail`: the error text, `master` (its address), `survivors` (master or producer processes left) and
    `metrics_kept` (whether metrics.jsonl still begins with what it held at the fault).
    """
    c, inputs = run or tiny_inputs()
    with tempfile.TemporaryDirectory(prefix="draftsmith-fault-") as tmp:
        stage = Path(workdir or tmp) / "train-online"
        online = {"window_samples": 4, "segment_mb": 16, "master_timeout_s": MASTER_TIMEOUT_S}
        hidden = _with(c.hidden_states, mode="online", online=online)
        cfg = _with(c.train, epochs=40, batch_tokens=256, checkpoint={"every_steps": 2, "keep": 100})
        seen: dict = {}

        def target() -> int | None:
            pids = descendants("mooncake_master")
            if pids:
                seen["master"], seen["metrics"] = _master_addr(pids[0]), (stage / "metrics.jsonl").read_text()
            return pids[0] if pids else None

        state = _faulted_run(c, inputs, stage, cfg, hidden, target, signal.SIGKILL, offline=False)
        survivors = descendants("mooncake_master") + descendants("-m draftsmith.tasks.hidden_stream")
        gone, bad = damaged(stage, state.get("committed", {}))
        kept = (stage / "metrics.jsonl").read_text().startswith(seen.get("metrics", "\0"))
        return FaultResult(
            fault="Mooncake master killed",
            units=len(state.get("committed", {})),
            lost=gone + int(not kept),
            corrupted=bad,
            injected=int("t" in state),
            detected_within_s=state["detected"],
            detail={
                "error": None if state["error"] is None else str(state["error"]),
                "master": seen.get("master"),
                "survivors": survivors,
                "metrics_kept": kept,
            },
        )


# The stream's owner, as a training rank holds it: the master and the producers are its children.
_PARENT = """
import json, sys, time
from pathlib import Path
from draftsmith.core.config import HiddenStatesConfig, TargetConfig
from draftsmith.core.manifest import StageManifest
from draftsmith.transport.online_source import OnlineSource
spec = json.loads(Path(sys.argv[1]).read_text())
parts = HiddenStatesConfig.model_validate(spec["hidden"]), TargetConfig.model_validate(spec["target"])
with OnlineSource(*parts, StageManifest.model_validate(spec["tokens"]), epochs=1000, run_id="parent",
                  producer_module="draftsmith.tasks.hidden_stream") as source:
    pids = {"master": source.master.proc.pid, "producers": [proc.pid for proc, _ in source.procs]}
    Path(sys.argv[2]).write_text(json.dumps(pids))
    time.sleep(600)
"""


def _start_parent(c, inputs, work: Path) -> tuple[subprocess.Popen, dict]:
    """The stream's owner in its own process, and the pids of the master and producers it started."""
    hidden = _with(c.hidden_states, mode="online", online={"num_producers": 2, "segment_mb": 16})
    spec = {"hidden": hidden.model_dump(mode="json"), "target": c.target.model_dump(mode="json")}
    spec["tokens"] = inputs["tokenize"].model_dump(mode="json")
    (work / "spec.json").write_text(json.dumps(spec))
    pids_path = work / "pids.json"
    with open(work / "parent.log", "wb") as log:
        parent = subprocess.Popen(
            [sys.executable, "-c", _PARENT, str(work / "spec.json"), str(pids_path)],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    deadline = time.monotonic() + 180
    while not pids_path.exists() and parent.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    if not pids_path.exists():
        parent.kill()
        raise RuntimeError(f"the stream's owner did not start: {(work / 'parent.log').read_text()[-2000:]}")
    pids = json.loads(pids_path.read_text())
    pids["alive"] = [p for p in [pids["master"], *pids["producers"]] if proctree.process_alive(p)]
    pids["argv"] = {p: cmdline(p) for p in pids["alive"]}
    return parent, pids


def parent_killed(workdir: str | Path | None = None, *, run: tuple | None = None) -> FaultResult:
    """SIGKILL a process holding an `OnlineSource` (its own `mooncake_master`, two local producers) and count
    the children still running `DEATH_S` later. The producers are frozen (SIGSTOP) first: a producer busy in
    a long forward or an engine start-up would not notice its queue closing, so only a death signal armed
    at its start ends it in time.

    `detail`: `children` (master and producer pids), `alive_before` (those running at the kill), `survivors`.
    """
    c, inputs = run or tiny_inputs()
    with tempfile.TemporaryDirectory(prefix="draftsmith-fault-") as tmp:
        work = Path(workdir or tmp) / "parent"
        work.mkdir(parents=True, exist_ok=True)
        parent, pids = _start_parent(c, inputs, work)
        children = [pids["master"], *pids["producers"]]
        try:
            for pid in pids["producers"]:
                os.kill(pid, signal.SIGSTOP)
            parent.send_signal(signal.SIGKILL)
            parent.wait()
            killed = time.monotonic()
            while any(proctree.process_alive(p) for p in children) and time.monotonic() - killed < DEATH_S:
                time.sleep(0.02)
            took = time.monotonic() - killed
            survivors = [p for p in children if proctree.process_alive(p)]
        finally:
            parent.kill()
            for pid in children:
                _release(pid, pids["argv"].get(pid))
        return FaultResult(
            fault="stream owner killed",
            units=len(children),
            duplicated=len(survivors),
            injected=1,
            detected_within_s=took,
            detail={"children": children, "alive_before": pids["alive"], "survivors": survivors},
        )


SCENARIOS: dict[str, Callable[[], FaultResult]] = {
    "mooncake-master-killed": master_killed,
    "rank-killed": functools.partial(rank_lost, "killed"),
    "rank-stopped": functools.partial(rank_lost, "stopped"),
    "stream-owner-killed": parent_killed,
}
