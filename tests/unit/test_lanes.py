"""`tests/support/lanes.py`, the scheduler of `make test`, driven as pytest-xdist drives it: the lane takes the
waiting files first and never a vLLM one, one vLLM file runs at a time, every test runs once, files stay whole,
and every worker is told to stop once nothing is left for it."""

import itertools
import re
from types import SimpleNamespace

import pytest

from tests.support import lanes
from tests.support.lanes import LaneScheduling, scope_of
from tests.support.paths import ROOT

pytestmark = pytest.mark.unit

WAIT = [f"tests/w{i}.py" for i in range(1, 5)]
HEAVY = [f"tests/v{i}.py" for i in range(1, 4)]
PLAIN = [f"tests/p{i}.py" for i in range(1, 9)]
COLLECTION = [f"{f}::test_{k}" for f in PLAIN + WAIT + HEAVY for k in range(2)]


class Node:
    """What the scheduler uses of xdist's WorkerController: the items it is sent, and shutdown."""

    def __init__(self, name: str) -> None:
        self.gateway = SimpleNamespace(id=name)
        self.shutting_down = False
        self.sent: list[str] = []
        self.done = 0

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent += [COLLECTION[i] for i in indices]

    def shutdown(self) -> None:
        self.shutting_down = True


@pytest.fixture(autouse=True)
def _files(monkeypatch):
    monkeypatch.setattr(lanes, "WAITING", frozenset(WAIT))
    monkeypatch.setattr(lanes, "VLLM", frozenset(HEAVY))


def _scheduler(workers: int) -> tuple[LaneScheduling, list[Node]]:
    config = SimpleNamespace(
        getvalue=lambda name: {"tx": [f"{workers}*popen"]}[name], option=SimpleNamespace(loadscopereorder=False)
    )
    sched = LaneScheduling(config)
    nodes = [Node(f"gw{i}") for i in range(workers)]
    for node in nodes:
        sched.add_node(node)
        sched.add_node_collection(node, COLLECTION)
    sched.schedule()
    return sched, nodes


def _run(sched: LaneScheduling, nodes: list[Node], speeds: list[int]) -> list[set[str]]:
    """Each node finishes its next test in turn, `speeds[i]` tests a round, as xdist's workers do: a worker runs
    the last test it was sent only once it is sent another or told to stop, and the controller stops every
    worker once the scheduler says the tests are finished. Returns the vLLM files in progress after each report;
    fails when a round moves nothing (the run would hang until CI's limit)."""
    overlaps = []
    while not all(node.shutting_down and node.done == len(node.sent) for node in nodes):
        moved = False
        for node, speed in zip(nodes, speeds, strict=True):
            for _ in range(speed):
                if node.done < len(node.sent) - 1 or (node.shutting_down and node.done < len(node.sent)):
                    sched.mark_test_complete(node, COLLECTION.index(node.sent[node.done]))
                    node.done += 1
                    moved = True
                    if sched.tests_finished:
                        for each in nodes:
                            each.shutdown()
                    overlaps.append({scope_of(nd.sent[nd.done]) for nd in nodes if nd.done < len(nd.sent)} & set(HEAVY))
        assert moved, f"hung: queued {list(sched.workqueue)}, held {[nd.sent[nd.done :] for nd in nodes]}"
    return overlaps


def _check_whole_and_once(nodes: list[Node]) -> None:
    assert sorted(n for node in nodes for n in node.sent) == sorted(COLLECTION)
    for node in nodes:
        mine = {scope_of(n) for n in node.sent}
        others = {scope_of(n) for other in nodes if other is not node for n in other.sent}
        assert not mine & others, "a file was split between workers"
    assert all(node.shutting_down and node.done == len(node.sent) for node in nodes)


@pytest.mark.parametrize("speeds", [[1, 1, 1], [3, 1, 1], [1, 1, 4]])
def test_three_workers_run_everything_once_with_a_lane_and_one_vllm_file_at_a_time(speeds):
    sched, nodes = _scheduler(3)
    lane = nodes[-1]
    assert sched.lane_node is lane
    assert {scope_of(n) for n in lane.sent} <= set(WAIT), "the lane starts on the waiting files"
    assert not {scope_of(n) for n in nodes[0].sent + nodes[1].sent} & set(WAIT)
    overlaps = _run(sched, nodes, speeds)
    _check_whole_and_once(nodes)
    assert not {scope_of(n) for n in lane.sent} & set(HEAVY), "the lane ran a vLLM file"
    assert all(len(running) <= 1 for running in overlaps), "two vLLM files were in progress at once"


def test_no_mix_of_worker_speeds_hangs_the_run():
    # The vLLM chain left for last (a slow worker on it, fast ones done with everything else) once held the
    # last test of one vLLM file and with it the next file, with nothing to wake either.
    for workers in (2, 3):
        for speeds in itertools.product(range(1, 5), repeat=workers):
            sched, nodes = _scheduler(workers)
            overlaps = _run(sched, nodes, list(speeds))
            _check_whole_and_once(nodes)
            assert all(len(running) <= 1 for running in overlaps), speeds


def test_the_lane_takes_other_files_once_the_waiting_ones_are_done():
    sched, nodes = _scheduler(3)
    _run(sched, nodes, [1, 1, 6])
    lane_files = [scope_of(n) for n in nodes[-1].sent]
    assert set(WAIT) <= set(lane_files) and set(lane_files) & set(PLAIN), lane_files
    first_plain = min(i for i, f in enumerate(lane_files) if f in PLAIN)
    assert all(i < first_plain for i, f in enumerate(lane_files) if f in WAIT), lane_files


def test_with_two_workers_there_is_no_lane_but_still_one_vllm_file_at_a_time():
    sched, nodes = _scheduler(2)
    assert sched.lane_node is None
    overlaps = _run(sched, nodes, [1, 2])
    _check_whole_and_once(nodes)
    assert all(len(running) <= 1 for running in overlaps)


def test_a_crashed_worker_fails_its_test_and_a_new_one_runs_the_rest_of_the_file():
    sched, nodes = _scheduler(3)
    victim = nodes[0]
    first = victim.sent[0]
    assert sched.remove_node(victim) == first  # it crashed on its first test
    new = Node("gw3")
    sched.add_node(new)
    sched.add_node_collection(new, COLLECTION)
    sched.schedule()
    nodes = [nodes[1], nodes[2], new]
    _run(sched, nodes, [1, 1, 1])
    ran = [n for node in nodes for n in node.sent]
    assert first not in ran, "the crashed test was sent again (it would crash the new worker too)"
    assert sorted(ran + victim.sent[:1]) == sorted(COLLECTION)
    assert all(node.shutting_down for node in nodes)


def test_a_test_belongs_to_its_file():
    assert scope_of("tests/a.py::Class::test_1[x::y]") == "tests/a.py"
    assert scope_of("tests/b.py") == "tests/b.py"


def test_the_lists_name_existing_files_and_every_vllm_file(monkeypatch):
    monkeypatch.undo()  # the real lists
    assert lanes.WAITING and all((ROOT / f).is_file() for f in lanes.WAITING), sorted(lanes.WAITING)
    marked = {
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").rglob("test_*.py")
        if re.search(r"""mark\.venv\(["']vllm["']\)""", p.read_text())
    }
    assert lanes.VLLM == marked, sorted(lanes.VLLM ^ marked)
    assert not lanes.WAITING & lanes.VLLM
