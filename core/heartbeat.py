"""Heartbeats of dispatched stages, in the run folder both pools reach: `<run>/.heartbeats/<stage>.json`.

A `stage/<pool>` flow run writes `{flow_run, beat, host, pid, at}` every `dispatch.heartbeat_s` while it runs
(`beating`); the flow run that dispatched it reads the record back (`read_beat`) and calls the stage lost
when it has stood still for `dispatch.lost_after_s` while Prefect still says Running. The parent compares
records, not the `at` times they carry, on its own monotonic clock, so skew between hosts does not matter.
Prefect itself would keep such a flow run Running forever: its process was killed with its node, and
nothing is left to report a final state.
"""

import contextlib
import json
import logging
import os
import socket
import threading
from collections.abc import Iterator
from datetime import UTC, datetime

from draftsmith.core import storage

log = logging.getLogger(__name__)

FOLDER = ".heartbeats"


def heartbeat_url(run_dir: str, stage: str) -> str:
    return storage.join(run_dir, FOLDER, f"{stage}.json")


def read_beat(run_dir: str, stage: str) -> dict | None:
    """The last heartbeat record of `stage`, or None when there is none (or it cannot be read now)."""
    try:
        record = json.loads(storage.read_bytes(heartbeat_url(run_dir, stage)))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


@contextlib.contextmanager
def beating(run_dir: str, stage: str, flow_run: str, every_s: float) -> Iterator[None]:
    """Write `stage`'s heartbeat, naming `flow_run`, now and every `every_s` until the block ends."""
    url = heartbeat_url(run_dir, stage)
    stop = threading.Event()

    def beat(n: int) -> None:
        record = {
            "flow_run": flow_run, "beat": n, "host": socket.gethostname(), "pid": os.getpid(),
            "at": datetime.now(UTC).isoformat(timespec="seconds"),
        }  # fmt: skip
        storage.write_bytes(url, json.dumps(record).encode() + b"\n")

    def loop() -> None:
        n = 1
        while not stop.wait(every_s):
            n += 1
            try:
                beat(n)
            except OSError as err:  # a blip: the parent allows several missed beats before it calls us lost
                log.warning("%s: heartbeat not written (%s)", stage, err)

    beat(0)
    thread = threading.Thread(target=loop, name=f"heartbeat-{stage}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
