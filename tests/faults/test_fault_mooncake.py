"""The Mooncake master killed in the middle of a stream, and the stream's owner killed under its children.

With a real `mooncake_master` (SIGKILLed by PID): both ends of a stream fail with `MasterLost`, naming the
master's address and the announced samples lost with it, within seconds when a put or get fails, and within
`master_timeout_s` when nothing moves; online training then fails with one error, one traceback, no Mooncake
log lines pasted in, and the checkpoints and metrics it committed before keep their bytes and still load.
A SIGKILLed process that started a master and producers takes them with it, even frozen producers.
"""

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from draftsmith.drafters.training.torchrun import GRACE_S
from draftsmith.transport.mooncake_store import MooncakeMaster, stop_process
from draftsmith.transport.mooncake_stream import MASTER_PROBE_S, MasterLost, MooncakeStream
from tests.support.faults.stream import DEATH_S, MASTER_TIMEOUT_S, master_killed, parent_killed

pytestmark = pytest.mark.integration

PRODUCER = Path(__file__).resolve().parents[1] / "integration" / "mooncake_producer_main.py"
# Mooncake's own calls against a dead master fail within about 5 s; the error follows at once.
CALL_FAILS_S = 10.0


def _producer(master, stream, tmp_path, run_id, **opts) -> subprocess.Popen:
    """A producer process (`tests/integration/mooncake_producer_main.py`) lending no memory to the store."""
    args = [
        sys.executable,
        str(PRODUCER),
        f"--settings={json.dumps(dataclasses.asdict(master.settings(global_segment_bytes=0)))}",
        f"--queue={stream.address}",
        f"--codec={json.dumps(dataclasses.asdict(stream.codec))}",
        f"--run-id={run_id}",
        f"--producer-id={run_id}-p0",
    ] + [f"--{k.replace('_', '-')}={v}" for k, v in opts.items()]
    with open(tmp_path / f"{run_id}.log", "wb") as log:
        return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def _queued_announcements(stream) -> int:
    """Sample records waiting in the consumer's queue (the producer's lead), read without taking them."""
    events = stream._server._events
    with events.mutex:
        return sum(ev.kind == "message" and ev.body.get("type") == "sample" for ev in events.queue)


def _consume_and_kill(stream, master, after: int, pause_s: float, lead: int = 0) -> tuple[str, float]:
    """Read samples (`pause_s` each, a slow trainer); SIGKILL the master after `after`, once at least `lead`
    more are announced (a loaded machine can slow the producer); (error, seconds to it)."""
    killed = None
    with pytest.raises(MasterLost) as err:
        for i, _ in enumerate(stream):
            if i + 1 == after:
                deadline = time.monotonic() + 60
                while _queued_announcements(stream) < lead and time.monotonic() < deadline:
                    time.sleep(0.05)
                os.kill(master.proc.pid, signal.SIGKILL)
                killed = time.monotonic()
            time.sleep(pause_s)
    assert killed is not None
    return str(err.value), time.monotonic() - killed


@pytest.mark.timeout(120)
def test_the_master_killed_mid_stream_fails_both_ends_naming_it_and_the_samples_lost(tmp_path):
    run_id = "run-master"
    with MooncakeMaster(log_dir=tmp_path) as master:
        settings = master.settings(global_segment_bytes=16 << 20)
        with MooncakeStream(settings, peer_timeout_s=60, connect_timeout_s=60, master_timeout_s=30) as stream:
            # ~40 MiB of samples through a 16 MiB segment: the producer is held by back-pressure, far ahead.
            proc = _producer(master, stream, tmp_path, run_id, count=200, hidden=512, min_len=64, max_len=128)
            try:
                text, waited = _consume_and_kill(stream, master, after=3, pause_s=0.3, lead=2)
                rc = proc.wait(timeout=60)
            finally:
                stop_process(proc)
    print(f"master SIGKILLed mid-stream: the consumer failed {waited:.1f} s later")
    assert text.startswith(f"the Mooncake master at {master.master_addr} stopped answering"), text
    lost = re.search(rf"(\d+) announced samples not yet read were lost with it \({run_id}-p0 seq (\d+)-(\d+)\)", text)
    assert lost and int(lost[1]) == int(lost[3]) - int(lost[2]) + 1 >= 2, text
    assert int(lost[2]) == 3 and "3 samples had been read" in text, text  # seqs 0-2 were read, 3 on are gone
    assert waited < CALL_FAILS_S, waited  # a failed call, not the 30 s bound
    log = (tmp_path / f"{run_id}.log").read_text()
    assert rc == 3 and f"the Mooncake master at {master.master_addr} stopped answering" in log, (rc, log[-3000:])


@pytest.mark.timeout(60)
def test_a_master_gone_while_nothing_moves_is_noticed_within_master_timeout_s(tmp_path):
    run_id, bound = "run-idle", 3.0
    with MooncakeMaster(log_dir=tmp_path) as master:
        settings = master.settings(global_segment_bytes=16 << 20)
        with MooncakeStream(settings, peer_timeout_s=60, connect_timeout_s=60, master_timeout_s=bound) as stream:
            # After two samples the producer only sends heartbeats: no call fails, the probe must notice.
            proc = _producer(master, stream, tmp_path, run_id, count=10, hang_after=2)
            try:
                text, waited = _consume_and_kill(stream, master, after=2, pause_s=0)
            finally:
                stop_process(proc)
    print(f"master SIGKILLed while idle: the consumer failed {waited:.1f} s later (master_timeout_s={bound:g})")
    assert text.startswith(f"the Mooncake master at {master.master_addr} stopped answering"), text
    assert f"master_timeout_s={bound:g}" in text and "no sample was unread" in text, text
    assert bound <= waited < bound + 2 * MASTER_PROBE_S + 1, waited


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_master_killed_during_online_training_fails_once_and_keeps_what_was_committed(tiny_cfg, tiny_run, tmp_path):
    r = master_killed(tmp_path, run=(tiny_cfg, tiny_run))
    error = r.detail["error"]
    assert r.injected == 1 and error is not None, f"the fault did not fail the run: {r}"
    first = error.splitlines()[0]
    print(f"master SIGKILLed during training: the run failed {r.detected_within_s:.1f} s later: {first[:300]}")
    assert f"MasterLost: the Mooncake master at {r.detail['master']} stopped answering" in first, first
    assert re.search(r"\d+ announced samples not yet read were lost with it", first), first
    assert re.search(r"training stopped at step \d+; checkpoint \S+ \(step \d+\) is complete and untouched", error)
    # One error: the rank's own traceback only, no chained exceptions, no producer log or Mooncake log lines.
    assert error.count("Traceback (most recent call last)") == 1, error
    assert not re.search(r"^\S*[IWEF]\d{4} \d\d:\d\d:\d\d", error, re.M), error
    assert r.detected_within_s < MASTER_TIMEOUT_S + 2 * GRACE_S, r
    assert r.units >= 1 and (r.lost, r.corrupted) == (0, 0) and r.detail["metrics_kept"], r
    assert r.detail["survivors"] == [], r.detail


@pytest.mark.timeout(240)
def test_the_master_and_producers_die_with_the_process_that_started_them(tiny_cfg, tiny_run, tmp_path):
    r = parent_killed(tmp_path, run=(tiny_cfg, tiny_run))
    print(f"stream owner SIGKILLed: its {r.units} children were gone {r.detected_within_s:.2f} s later")
    assert r.units == 3 and r.detail["alive_before"] == r.detail["children"], r.detail  # a master and 2 producers
    assert r.detail["survivors"] == [] and r.duplicated == 0, r
    assert r.detected_within_s < DEATH_S, r
