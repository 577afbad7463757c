"""The pytest-xdist scheduler of `make test` (`pytest -n 3 --dist loadfile`): files as units, a lane for the
files that mostly wait, and one vLLM file at a time.

- Some files spend most of their wall time waiting, not computing: for a lease to expire, a heartbeat to go
  stale, a killed master or server to be noticed (`WAITING`: measured, under half their wall time on a core).
  On two workers they hold a worker, and with it half the machine, while a core sits idle. With three workers
  or more the last is a lane: it takes the waiting files first, then any file but a vLLM one; the others take
  the waiting files only once nothing else is left.
- A vLLM file starts several engines of 2-3 GB each (`VLLM`, the files marked `venv("vllm")`); two side by
  side took a 24 GB machine to 21 GB. So one runs at a time: while one is running on another worker, a worker
  takes another file instead, or waits for the next test to finish if nothing else is left. The worker running
  it may queue the next vLLM file behind its own: pytest ends a file's module fixtures (its engines) before the
  next file's start.
- An xdist worker runs the last test it was sent only once it is sent another or told to stop (it must know the
  next test to tear down the right fixtures). So a worker down to one test counts as idle: it is given work, or
  stopped, whenever any test ends; left waiting, it would hold its test, and a vLLM file's last test would hold
  every queued vLLM file, until CI's limit.
- Files stay whole on one worker, as with plain `--dist loadfile`: their module fixtures (a served engine, a
  trained run) are made once per file.
- A worker that crashes fails the test it was running; the rest of that file goes to a new worker.
"""

from collections.abc import Sequence
from typing import Any

from xdist.scheduler.loadscope import LoadScopeScheduling

WAITING = frozenset(
    {
        "tests/faults/test_fault_dispatch_watch.py",
        "tests/faults/test_fault_mooncake.py",
        "tests/faults/test_fault_s3.py",
        "tests/faults/test_fault_s3_lease.py",
        "tests/faults/test_fault_workers.py",
        "tests/integration/test_mooncake_stream.py",
        "tests/integration/test_s3_store.py",
    }
)
VLLM = frozenset(
    {
        "tests/integration/test_eval_sweep.py",
        "tests/integration/test_peer_quality_smoke.py",
        "tests/integration/test_speedup_vllm.py",
        "tests/integration/test_vllm_engines.py",
        "tests/integration/test_vllm_hidden.py",
        "tests/integration/test_vllm_serve_drafters.py",
        "tests/integration/test_vllm_stage.py",
    }
)
LANE_WORKERS = 3  # the fewest workers with which one of them is kept for the lane


def scope_of(nodeid: str) -> str:
    """A test's work unit: its file."""
    return nodeid.partition("::")[0]


class LaneScheduling(LoadScopeScheduling):
    """`--dist loadfile` with a lane for the `WAITING` files and one `VLLM` file at a time."""

    lane_node: Any = None

    def _split_scope(self, nodeid: str) -> str:
        return scope_of(nodeid)

    def schedule(self) -> None:
        if self.collection is None and len(self.nodes) >= LANE_WORKERS:
            scopes = {scope_of(n) for c in self.registered_collections.values() for n in c}
            if scopes & WAITING:
                self.lane_node = self.nodes[-1]
        super().schedule()

    def _vllm_running_beside(self, node: Any) -> bool:
        """A vLLM file in progress on a worker other than `node`."""
        return any(
            scope in VLLM and not all(unit.values())
            for other, work in self.assigned_work.items()
            if other is not node
            for scope, unit in work.items()
        )

    def _next_scope(self, node: Any) -> str | None:
        """The first queued file this node may take now, by the rules above; None: none for now."""
        allowed = [s for s in self.workqueue if not (s in VLLM and self._vllm_running_beside(node))]
        if node is self.lane_node:
            order = [s for s in allowed if s in WAITING] + [s for s in allowed if s not in WAITING | VLLM]
        else:  # vLLM files first, since they run one after another: a chain that must not start last
            order = [s for s in allowed if s in VLLM] + [s for s in allowed if s not in WAITING | VLLM]
            order += [s for s in allowed if s in WAITING]
        return order[0] if order else None

    def _assign_work_unit(self, node: Any) -> None:
        scope = self._next_scope(node)
        if scope is None:
            return
        work_unit = self.workqueue.pop(scope)
        self.assigned_work.setdefault(node, {})[scope] = work_unit
        collection: Sequence[str] = self.registered_collections[node]
        node.send_runtest_some([collection.index(n) for n, done in work_unit.items() if not done])

    def _done_for_good(self, node: Any) -> bool:
        """Nothing queued that this node could ever take (a vLLM file now running elsewhere ends)."""
        if node is self.lane_node:
            return not any(s not in VLLM for s in self.workqueue)
        return not self.workqueue

    def _reschedule(self, node: Any) -> None:
        if node.shutting_down:
            return
        if self._done_for_good(node):
            node.shutdown()
            return
        if self._pending_of(self.assigned_work[node]) > 2:
            return
        self._assign_work_unit(node)

    def remove_node(self, node: Any) -> str | None:
        """A worker is gone: at the end, or crashed (killed, or ended by tests/support/watchdog.py). The test it
        was running is returned as crashed and the rest of its file is queued again, without that test:
        xdist's `--dist loadfile` queues it too, and it then takes down one new worker after another."""
        workload = self.assigned_work.pop(node)
        pending = [nodeid for unit in workload.values() for nodeid, done in unit.items() if not done]
        if not pending:
            return None
        crashed = pending[0]  # a worker runs its tests in the order they were sent
        workload[scope_of(crashed)][crashed] = True
        self.workqueue.update({scope: unit for scope, unit in workload.items() if not all(unit.values())})
        for other in self.assigned_work:
            self._reschedule(other)
        return crashed

    def mark_test_complete(self, node: Any, item_index: int, duration: float = 0) -> None:
        super().mark_test_complete(node, item_index, duration)
        # A worker left idle while a vLLM file ran gets no event of its own: give it work when any test ends. One
        # test left is idle too: the worker holds it until it is sent another or told to stop.
        for other in self.nodes:
            if other is not node and self._pending_of(self.assigned_work[other]) <= 1:
                self._reschedule(other)
