"""Capture windows: bounded by tokens, never across a shard boundary, so a resumed capture batches alike."""

import pytest
import torch

from draftsmith.engines.hidden_capture import capture_stream
from draftsmith.transport.sample import HiddenSample

pytestmark = pytest.mark.unit


class RecordingEngine:
    """Returns one sample per input and records each call's sample ids (a window)."""

    def __init__(self):
        self.windows: list[list[str]] = []

    def capture(self, samples: list[dict]) -> list[HiddenSample]:
        self.windows.append([s["id"] for s in samples])
        return [
            HiddenSample(
                id=s["id"],
                input_ids=s["input_ids"],
                loss_mask=s["loss_mask"],
                hidden_states=torch.zeros(len(s["input_ids"]), 2),
                last_hidden=torch.zeros(len(s["input_ids"]), 1),
            )
            for s in samples
        ]

    def close(self) -> None:
        pass


def samples(lengths: list[int]) -> list[dict]:
    return [
        {"id": f"s{i}", "input_ids": torch.zeros(n, dtype=torch.long), "loss_mask": torch.ones(n, dtype=torch.bool)}
        for i, n in enumerate(lengths)
    ]


LENGTHS = [7, 3, 12, 5, 9, 1, 4, 8, 6, 2, 11, 3, 5]


def test_windows_keep_order_and_the_token_bound_without_a_boundary():
    engine = RecordingEngine()
    out = [s.id for s in capture_stream(engine, samples(LENGTHS), window_tokens=16)]
    assert out == [f"s{i}" for i in range(len(LENGTHS))]
    assert [w[0] for w in engine.windows] == ["s0", "s3", "s7", "s10"]  # each window closes once it holds >= 16


@pytest.mark.parametrize("boundary", [1, 3, 4, 5])
def test_no_window_crosses_a_boundary(boundary):
    engine = RecordingEngine()
    out = [s.id for s in capture_stream(engine, samples(LENGTHS), window_tokens=16, boundary=boundary)]
    assert out == [f"s{i}" for i in range(len(LENGTHS))]
    for window in engine.windows:
        first, last = int(window[0][1:]), int(window[-1][1:])
        assert first // boundary == last // boundary, (boundary, window)


@pytest.mark.parametrize("committed_shards", [1, 2, 3])
def test_a_resume_at_a_boundary_forms_the_uninterrupted_windows(committed_shards):
    boundary = 4
    whole, resumed = RecordingEngine(), RecordingEngine()
    list(capture_stream(whole, samples(LENGTHS), window_tokens=16, boundary=boundary))
    tail = samples(LENGTHS)[committed_shards * boundary :]
    list(capture_stream(resumed, tail, window_tokens=16, boundary=boundary))
    done = {f"s{i}" for i in range(committed_shards * boundary)}
    assert resumed.windows == [w for w in whole.windows if w[0] not in done]


def test_a_boundary_must_be_positive():
    with pytest.raises(ValueError, match="boundary 0"):
        list(capture_stream(RecordingEngine(), samples([3]), window_tokens=16, boundary=0))


def test_the_stage_windows_end_at_its_shards_and_hold_two_forward_budgets():
    """Both the offline stage and the online producer call `capture_windows`, so they batch alike."""
    from draftsmith.core.config import HiddenStatesConfig
    from draftsmith.tasks.hidden_states import capture_windows

    cfg = HiddenStatesConfig(taps=[1, 2, 3], batch_tokens=4, shard_samples=3)
    engine, direct = RecordingEngine(), RecordingEngine()
    out = [s.id for s in capture_windows(engine, samples(LENGTHS), cfg)]
    list(capture_stream(direct, samples(LENGTHS), window_tokens=8, boundary=3))
    assert out == [f"s{i}" for i in range(len(LENGTHS))]
    assert engine.windows == direct.windows
    # Closed by 8 tokens (s0, s3, s6, s9 start one) or by a shard end (after s2, s5, s8, s11).
    assert [w[0] for w in engine.windows] == ["s0", "s2", "s3", "s5", "s6", "s8", "s9", "s11", "s12"]
