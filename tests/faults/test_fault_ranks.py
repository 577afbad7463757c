"""One of two training ranks lost, for real: torchrun runs 2 gloo ranks on the tiny drafter and, once a
checkpoint is committed, rank 1 is SIGKILLed, or stopped with SIGSTOP for longer than
`train.distributed.timeout_s`. The run fails within a bound with an error naming rank 1, not rank 0 whose
collective broke because of it, and leaves no rank behind; the checkpoints committed before the fault keep
their bytes and still load, and a rerun resumes from the newest of them and records every step once.
"""

import pytest

from draftsmith.drafters.training.rank_health import HEARTBEAT_S
from draftsmith.drafters.training.torchrun import GRACE_S
from tests.support.faults.stream import STALL_S, rank_lost

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]


def _first_line(r) -> str:
    assert r.injected == 1 and r.detail["error"] is not None, f"the fault did not fail the run: {r}"
    return r.detail["error"].splitlines()[0]


def _assert_recovered(r) -> None:
    assert r.detail["survivors"] == [], r.detail
    assert r.detail["newest"] >= 2, r.detail
    assert r.detail["resumed_at"] == r.detail["newest"], r.detail  # the newest committed step, not step 0
    assert (r.lost, r.duplicated, r.corrupted) == (0, 0, 0), r


def test_a_sigkilled_rank_is_named_and_the_rerun_resumes_from_the_last_checkpoint(tiny_cfg, tiny_run, tmp_path):
    r = rank_lost("killed", tmp_path, run=(tiny_cfg, tiny_run))
    first = _first_line(r)
    assert r.detail["rank"] == 1 and "rank 1 (pid" in first and "SIGKILL" in first, first
    # torchrun notices a dead rank at once and stops the other one within its grace period.
    assert r.detected_within_s < 2 * GRACE_S, r
    print(f"rank SIGKILLed: failed {r.detected_within_s:.1f} s later; rerun resumed at step {r.detail['resumed_at']}")
    _assert_recovered(r)


def test_a_stopped_rank_is_named_once_past_its_bound_and_the_rerun_resumes(tiny_cfg, tiny_run, tmp_path):
    r = rank_lost("stopped", tmp_path, run=(tiny_cfg, tiny_run))
    first = _first_line(r)
    assert r.detail["rank"] == 1 and "rank 1 (pid" in first and "stopped" in first, first
    assert f"train.distributed.timeout_s = {STALL_S} s" in first, first
    # Not before the bound (its last heartbeat may precede the stop by one period), and not long after it.
    assert STALL_S - HEARTBEAT_S <= r.detected_within_s < STALL_S + 2 * GRACE_S, r
    print(f"rank stopped: failed {r.detected_within_s:.1f} s later; rerun resumed at step {r.detail['resumed_at']}")
    _assert_recovered(r)
