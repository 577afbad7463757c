"""How a dispatching flow run watches its `stage/<pool>` flow run (`core/run_watch.py`) on a scripted client: a run
that ends (cancelled from the UI) ends the wait, a deleted one and a server gone for too long fail in one line, a
Running run whose heartbeat stands still is lost, and one whose heartbeat moves is not; and how it starts a
crashed or lost one again per `dispatch.retries` (`dispatch._run_watched`)."""

import os
import time
import uuid
from types import SimpleNamespace

import httpx
import pytest
from prefect.client.schemas.objects import State
from prefect.exceptions import ObjectNotFound
from prefect.states import Cancelled, Pending, Running

from draftsmith.core import heartbeat, run_watch
from draftsmith.core.config.stages import DispatchConfig
from draftsmith.flows import dispatch

pytestmark = pytest.mark.unit
CFG = DispatchConfig(heartbeat_s=0.5, lost_after_s=2.0)


class Client:
    """Answers `read_flow_run` from `script` in turn (its last step for ever): a state, or an exception to raise."""

    def __init__(self, *script) -> None:
        self.script, self.reads = list(script), 0

    def read_flow_run(self, run_id):
        self.reads += 1
        step = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        if isinstance(step, BaseException):
            raise step
        return SimpleNamespace(id=run_id, name="stage[x]", state=step)


def _child():
    return SimpleNamespace(id=uuid.uuid4(), name="select_prompts[tiny-cpu]", state=Pending())


def test_a_run_cancelled_from_the_ui_ends_the_wait_with_its_state(tmp_path):
    run, lost = run_watch.watch(Client(Pending(), Running(), Cancelled()), _child(), "s", str(tmp_path), CFG)
    assert lost is None and run.state is not None and run.state.is_cancelled()


def test_a_run_deleted_while_it_ran_fails_in_one_line(tmp_path):
    child = _child()
    gone = ObjectNotFound(http_exc=Exception("404"))
    with pytest.raises(run_watch.WatchError, match=rf"flow run select_prompts\[tiny-cpu\] \({child.id}\) was deleted"):
        run_watch.watch(Client(Running(), gone), child, "s", str(tmp_path), CFG)


def test_a_server_that_stays_away_fails_the_wait_after_lost_after_s(tmp_path):
    down = httpx.ConnectError("refused")
    start = time.monotonic()
    with pytest.raises(run_watch.WatchError, match=r"Prefect server did not answer for 2 s .*ConnectError"):
        run_watch.watch(Client(down), _child(), "s", str(tmp_path), CFG)
    assert CFG.lost_after_s <= time.monotonic() - start < CFG.lost_after_s + 3
    # Back in time (a restart): the wait goes on to the run's end.
    run, lost = run_watch.watch(Client(down, down, Cancelled()), _child(), "s", str(tmp_path), CFG)
    assert lost is None and run.state is not None and run.state.is_cancelled()


def test_a_running_run_whose_heartbeat_stands_still_is_lost_and_one_that_beats_is_not(tmp_path):
    child = _child()
    with heartbeat.beating(str(tmp_path), "s", str(child.id), CFG.heartbeat_s):
        ends: list[State] = [Running()] * 10 + [Cancelled()]  # about 5 s of beating, longer than lost_after_s
        run, lost = run_watch.watch(Client(*ends), child, "s", str(tmp_path), CFG)
        assert lost is None and run.state is not None and run.state.is_cancelled()
    start = time.monotonic()
    run, lost = run_watch.watch(Client(Running()), child, "s", str(tmp_path), CFG)  # the beating stopped
    assert lost is not None and lost.startswith("Running, but its heartbeat stood still for ")
    assert f"from pid {os.getpid()} on " in lost
    assert CFG.lost_after_s <= time.monotonic() - start <= CFG.lost_after_s + 2 * CFG.heartbeat_s + 1
    # Another run's beat (an earlier attempt's) is no beat of this one.
    run, lost = run_watch.watch(Client(Running()), _child(), "s", str(tmp_path), CFG)
    assert lost is not None and lost.endswith("(no beat)")


class _Marks:
    def __init__(self) -> None:
        self.states: list[tuple] = []

    def set_flow_run_state(self, run_id, state, force=False):
        self.states.append((run_id, state.type.value, force))


def _watched(monkeypatch, tiny_cfg, retries: int, *outcomes):
    """`dispatch._run_watched` where each started run's watch ends as the next of `outcomes`:
    a final state, or a reason it was lost."""
    import contextlib

    import prefect.client.orchestration

    marks, started = _Marks(), []
    monkeypatch.setattr(prefect.client.orchestration, "get_client", lambda **kw: contextlib.nullcontext(marks))

    def start(stage, name, params, target):
        started.append(_child())
        return started[-1]

    def watch(client, child, stage, run_dir, cfg):
        step = outcomes[len(started) - 1]
        return (SimpleNamespace(id=child.id, name=child.name, state=step), None) if isinstance(step, State) else (
            child, step
        )  # fmt: skip

    monkeypatch.setattr(dispatch, "_start", start)
    monkeypatch.setattr(run_watch, "watch", watch)
    cfg = tiny_cfg.model_copy(update={"dispatch": DispatchConfig(retries=retries)})
    target = dispatch._Target("stage/p", "p", "select.resources.work_pool", cfg.select.resources)
    return (lambda: dispatch._run_watched(cfg, "s", "runs/x", {}, target)), started, marks


def test_a_crashed_or_lost_stage_is_dispatched_again_per_retries_then_reported(monkeypatch, tiny_cfg):
    from prefect.states import Completed, Crashed

    run, started, marks = _watched(monkeypatch, tiny_cfg, 2, Crashed(message="pod evicted"), "gone", Completed())
    assert run().state.is_completed() and len(started) == 3
    assert marks.states == [(started[1].id, "CRASHED", True)]  # the lost one; Prefect had ended the other
    run, started, _ = _watched(monkeypatch, tiny_cfg, 0, Crashed(message="pod evicted"))
    assert run().state.is_crashed() and len(started) == 1  # no retries: reported as it ended
    run, started, marks = _watched(monkeypatch, tiny_cfg, 1, "gone", "gone again")
    with pytest.raises(dispatch.DispatchError, match=r"was lost: gone again; marked Crashed after 2 attempts\. "):
        run()
    assert [m[1] for m in marks.states] == ["CRASHED", "CRASHED"]
