"""Training progress, read in the parent from the trainer's output lines and its metrics.jsonl."""

import json
import logging
import time
from typing import Any

import pytest
import torch

from draftsmith.core.config import TrainConfig
from draftsmith.core.progress import Progress
from draftsmith.drafters.training.fsdp import Dist
from draftsmith.drafters.training.run import Recorder
from draftsmith.tasks.train import StepProgress, last_step, watching_metrics

pytestmark = pytest.mark.unit


class Recording(logging.Logger):
    def __init__(self) -> None:
        super().__init__("recording", logging.INFO)
        self.lines: list[str] = []

    def handle(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append(record.getMessage())
        except TypeError:  # as logging's own handlers do, keep going on a bad format string
            self.lines.append(str(record.msg))


def test_steps_are_read_from_rank0_lines_and_still_logged():
    inner, sent = Recording(), list[Any]()
    progress = Progress(None, sent.append, min_interval_s=0.0)
    tracker = StepProgress(inner, progress, max_steps=None)
    lines = [
        "launching /venv/bin/python -m torch.distributed.run --nnodes 1",
        "[rank0]:00:10:00,000 INFO draftsmith.drafters.training.worker: "
        "train: rank 0 of 2, 80 steps, resuming at step 20",
        "[rank1]:2026-11-30 00:10:01,000 INFO draftsmith.drafters.training.run: train: rank 1 trained 3 micro-batches",
        "[rank0]:2026-11-30 00:10:05,000 INFO draftsmith.drafters.training.metrics: "
        "train step 40 | loss 2.5 acc_0 0.31",
    ]
    for line in lines:
        tracker.info("%s", line)
    assert inner.lines == lines
    tracker.info("a stray %d", "not a number")  # a bad format string never stops the reader
    assert inner.lines[-1] == "a stray %d"
    assert progress.total == 80
    assert sent == [25.0, 50.0]


def test_an_older_step_never_moves_progress_back():
    progress = Progress(10, None)
    tracker = StepProgress(Recording(), progress, max_steps=None)
    tracker.info("[rank0]:... train step 3 | loss 1.0")
    assert progress.done == 3
    tracker.info("[rank0]:... train step 2 | loss 1.0")  # e.g. a metrics.jsonl read that lags the log
    assert progress.done == 3


def test_max_steps_caps_the_total():
    progress = Progress(None, None)
    StepProgress(Recording(), progress, max_steps=10).info("train: rank 0 of 1, 500 steps, resuming at step 0")
    assert progress.total == 10


def test_last_step_reads_the_last_complete_record(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert last_step(path) is None
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 5000)) + '{"step": 50')
    assert last_step(path) == 4999  # the torn record being written is skipped, the 64 KiB window is enough


def test_the_metrics_watcher_moves_progress(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 6}) + "\n")
    progress = Progress(None, None)
    tracker = StepProgress(Recording(), progress, None)
    with watching_metrics(path, tracker, every_s=0.01):
        time.sleep(0.1)
        assert progress.done == 0, "records read before the trainer's start line may be a resumed run's"
        tracker.info("train: rank 0 of 1, 12 steps, resuming at step 0")
        deadline = time.monotonic() + 5
        while progress.done < 6 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert progress.done == 6 and progress.percent() == 50.0


@pytest.mark.parametrize("rank,local_rank,lines", [(4, 0, 2), (5, 1, 0)])
def test_a_node_without_rank_0_still_draws_its_bar(caplog, rank, local_rank, lines):
    """On several nodes c10d may place rank 0 on another pod: that node's first rank marks the steps."""
    cfg = TrainConfig.model_validate({"metrics": {"log_every": 5}})
    rec = Recorder(cfg, Dist(rank=rank, world=8, local_rank=local_rank, device=torch.device("cpu")), sink=None)
    caplog.set_level(logging.INFO, logger="draftsmith.drafters.training")
    for step in range(1, 11):
        rec.step_done(step, epoch=0)
    marked = [m for m in caplog.messages if m.startswith("train step")]
    assert len(marked) == lines
    progress = Progress(None, None)
    tracker = StepProgress(Recording(), progress, None)
    tracker.info(f"[rank{rank}]:... train: rank {rank} of 8, 20 steps, resuming at step 0")
    for line in marked:
        tracker.info(f"[rank{rank}]:... {line}")
    assert progress.total == 20 and progress.done == 5 * lines
