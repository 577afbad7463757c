"""`drafters.training.rank_health` on torchrun's own words: which rank caused a failure, which output lines are
tracebacks, and when a live rank's heartbeat is stale. The real launches are in tests/faults/test_fault_ranks.py."""

import json
import os
import subprocess
import sys
import time

import pytest

from draftsmith.drafters.training import rank_health

pytestmark = pytest.mark.unit

# What torchrun 2.13 prints when rank 1 was SIGKILLed from outside and it then stopped rank 0 (abridged).
SUMMARY_OUTSIDE = """\
W1202 01:06:39.1 torch/distributed/elastic/multiprocessing/api.py:908] Sending process 4242 closing signal SIGTERM
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
draftsmith.drafters.training.worker FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-02_01:06:40
  host      : box
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 4242)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 4242
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-02_01:06:39
  host      : box
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 4243)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 4243
============================================================"""


def test_a_rank_killed_from_outside_is_the_cause_not_the_rank_torchrun_stopped():
    err = rank_health.failure("m", None, 1, 1, SUMMARY_OUTSIDE.splitlines(), 0)
    assert err.rank == 1
    assert str(err).startswith("torchrun m: rank 1 (pid 4243) was killed by SIGKILL (signal 9), not by torchrun")


def test_when_torchrun_sent_every_signal_no_rank_is_called_killed_from_outside():
    # Both ranks died of torchrun's own closing signals: the summary's root cause is all there is to go on.
    lines = SUMMARY_OUTSIDE.replace("exitcode  : -9 (pid: 4243)", "exitcode  : -15 (pid: 4243)").splitlines()
    lines.insert(0, "Sending process 4243 closing signal SIGTERM")
    err = rank_health.failure("m", None, 1, 1, lines, 0)
    assert "not by torchrun" not in str(err) and err.rank == 1, str(err)


def test_traceback_lines_are_told_apart_per_rank_and_end_at_the_exception():
    out = [  # (line, whether it belongs to a traceback)
        ("[rank0]:step 3 loss 1.25", False),
        ("[rank1]:Traceback (most recent call last):", True),
        ("[rank0]:step 4 loss 1.20", False),
        ('[rank1]:  File "w.py", line 3, in main', True),
        ("[rank1]:    raise ValueError('boom')", True),
        ("[rank1]:", True),
        ("[rank1]:During handling of the above exception, another exception occurred:", True),
        ("[rank1]:Traceback (most recent call last):", True),
        ('[rank1]:  File "w.py", line 5, in main', True),
        ("[rank1]:RuntimeError: boom again", True),
        ("[rank1]:exiting", False),
        # torch's own logging prefixes the rank once more, and a space
        ("[rank0]:[rank0]: Traceback (most recent call last):", True),
        ('[rank0]:[rank0]:   File "w.py", line 9, in main', True),
        ("[rank0]:[rank0]: RuntimeError: Connection closed by peer", True),
        ("[rank0]:[rank0]: exiting", False),
        # torchrun's own traceback, and its summary quoting the root cause's
        ("Traceback (most recent call last):", True),
        ('  File "run.py", line 1, in <module>', True),
        ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError:", True),
        ("  error_file: /tmp/error.json", False),
        ("  traceback : Traceback (most recent call last):", True),
        ('    File "w.py", line 3, in main', True),
        ("  ValueError: boom", True),
        ("  ", False),
        ("=====", False),
    ]
    t = rank_health.TracebackLines()
    assert [(line, t.within(line)) for line, _ in out] == out


def test_a_live_rank_whose_heartbeat_is_stale_is_stalled_and_an_exited_one_is_not(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        gone = subprocess.Popen([sys.executable, "-c", "pass"])
        gone.wait()
        for rank, pid in ((0, gone.pid), (1, sleeper.pid)):
            path = tmp_path / f"rank-{rank}.json"
            path.write_text(json.dumps({"rank": rank, "pid": pid, "stall_s": 2.0, "bound": "train.x"}))
            os.utime(path, (time.time() - 5, time.time() - 5))
        with pytest.raises(rank_health.Stalled) as info:
            rank_health.check_heartbeats(tmp_path)
        [(beat, age, state)] = info.value.args[0]
        assert beat["rank"] == 1 and age >= 5 and state in ("sleeping", "running")  # alive, whatever it does
        err = rank_health.stall_error("m", info.value, ["last line"])
        assert err.rank == 1 and "rank 1 (pid" in str(err) and "over train.x = 2 s" in str(err)
        os.utime(tmp_path / "rank-1.json")  # a fresh beat: nothing is stalled
        rank_health.check_heartbeats(tmp_path)
    finally:
        sleeper.kill()
        sleeper.wait()
