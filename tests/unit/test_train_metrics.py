"""Deferred metrics (one step late, no host sync of the current step), the JSONL/TensorBoard sink and the summary."""

import json
import logging

import pytest
import torch

from draftsmith.drafters.training.metrics import DeferredMetrics, MetricsSink, read_jsonl, summary_markdown

pytestmark = pytest.mark.unit

_SYNCING = {"item", "tolist", "numpy", "cpu", "__float__", "__int__", "__bool__", "__index__"}


class _NoSyncTensor(torch.Tensor):
    """A tensor that raises on every call that would make the host wait for (or read) its value."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _SYNCING:
            raise AssertionError(f"host sync on the current step's metrics: Tensor.{name}")
        if name == "to" and any(isinstance(a, torch.device | str) for a in [*args[1:], *(kwargs or {}).values()]):
            raise AssertionError("device move of the current step's metrics")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_push_returns_the_previous_step_and_flush_the_last():
    dm = DeferredMetrics(["loss", "acc_0"], torch.device("cpu"))
    assert dm.push(1, torch.tensor([2.5, 0.25])) is None
    assert dm.push(2, torch.tensor([1.5, 0.5], dtype=torch.bfloat16)) == {"step": 1, "loss": 2.5, "acc_0": 0.25}
    assert dm.push(3, torch.tensor([0.75, 0.625], dtype=torch.float64)) == {"step": 2, "loss": 1.5, "acc_0": 0.5}
    assert dm.flush() == {"step": 3, "loss": 0.75, "acc_0": 0.625}
    assert dm.flush() is None


def test_buffers_alternate_so_a_pending_copy_is_never_overwritten():
    dm = DeferredMetrics(["x"], torch.device("cpu"))
    got = [dm.push(s, torch.tensor([float(s)])) for s in range(1, 8)]
    assert got[0] is None
    assert [r and r["x"] for r in got[1:]] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    # The caller may reuse (overwrite) its device tensor in place after push: the value was already copied.
    v = torch.tensor([10.0])
    dm.push(8, v)
    v.fill_(-1.0)
    assert dm.push(9, v) == {"step": 8, "x": 10.0}


def test_push_never_reads_the_current_step_on_the_host():
    dm = DeferredMetrics(["loss", "grad_norm"], torch.device("cpu"))
    first = torch.tensor([3.0, 1.0]).as_subclass(_NoSyncTensor)
    second = torch.tensor([2.0, 0.5], requires_grad=True).as_subclass(_NoSyncTensor) * 1  # a non-leaf
    with pytest.raises(AssertionError, match="Tensor.item"):
        first.item()  # the guard itself works
    assert dm.push(1, first) is None
    assert dm.push(2, second) == {"step": 1, "loss": 3.0, "grad_norm": 1.0}
    assert dm.flush() == {"step": 2, "loss": 2.0, "grad_norm": 0.5}


def test_push_rejects_a_wrong_shape_and_bad_names():
    dm = DeferredMetrics(["loss", "lr"], torch.device("cpu"))
    with pytest.raises(ValueError, match=r"shape \[2\] \(loss, lr\), got \[3\]"):
        dm.push(1, torch.zeros(3))
    with pytest.raises(ValueError, match="unique"):
        DeferredMetrics(["a", "a"], torch.device("cpu"))
    with pytest.raises(ValueError, match="'step'"):
        DeferredMetrics(["step"], torch.device("cpu"))


def _records(steps, loss0=4.0):
    return [
        {"step": s, "loss": loss0 / s, "acc_0": 0.5, "acc_1": 0.25, "tokens_per_s": 1000.0, "skipped": 0} for s in steps
    ]


def test_sink_appends_flushed_lines_and_logs_every_n(tmp_path, caplog):
    path = tmp_path / "run" / "metrics.jsonl"
    log = logging.getLogger("test.metrics")
    sink = MetricsSink(path, tensorboard_dir=None, log_every=2, logger=log)
    with caplog.at_level(logging.INFO, logger="test.metrics"):
        for r in _records(range(1, 5)):
            sink.write(r)
            # Flushed per line: a reader (or a crash) sees every record written so far.
            assert read_jsonl(path)[-1]["step"] == r["step"]
    sink.write({"step": 5, "loss": float("nan"), "skipped": 1})
    sink.close()
    logged = [m for m in caplog.messages if m.startswith("train step")]
    assert logged == [
        "train step 2 | loss 2 acc_0 0.5 acc_1 0.25 tokens_per_s 1000 skipped 0",
        "train step 4 | loss 1 acc_0 0.5 acc_1 0.25 tokens_per_s 1000 skipped 0",
    ]
    records = read_jsonl(path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert records[-1] == {"step": 5, "loss": None, "skipped": 1}  # NaN is not JSON: written as null
    with pytest.raises(ValueError, match="integer 'step'"):
        MetricsSink(path, log_every=1).write({"loss": 1.0})


def test_resume_truncates_records_after_the_checkpoint_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricsSink(path, log_every=10) as sink:
        for r in _records(range(1, 8)):
            sink.write(r)
    # A crash mid-write leaves an unterminated line; reopening drops it, the resume drops steps past the checkpoint.
    with path.open("a") as fh:
        fh.write('{"step": 8, "lo')
    with MetricsSink(path, log_every=10) as sink:
        assert path.read_text().endswith("}\n")
        assert sink.truncate_after(5) == 2
        for r in _records(range(6, 9)):
            sink.write(r)
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3, 4, 5, 6, 7, 8]
    # Reopening without a resume appends after the existing records.
    with MetricsSink(path, log_every=10) as sink:
        sink.write({"step": 9})
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3, 4, 5, 6, 7, 8, 9]


def test_read_jsonl_names_file_and_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n\nnot json\n')
    with pytest.raises(ValueError, match=r"m\.jsonl:3: not a JSON record"):
        read_jsonl(path)
    path.write_text('{"step": 1}\n{"loss": 2.0}\n')
    with pytest.raises(ValueError, match=r"m\.jsonl:2: expected an object with an integer 'step'"):
        read_jsonl(path)
    path.write_text('{"step": 1}\n{"step": 2, "lo')
    with pytest.raises(ValueError, match=r"m\.jsonl:2"):
        read_jsonl(path)
    assert read_jsonl(path, tolerate_torn_tail=True) == [{"step": 1}]


def test_tensorboard_scalars_and_purge_on_resume(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = tmp_path / "tb"
    with MetricsSink(tmp_path / "m.jsonl", tensorboard_dir=tb, log_every=2) as sink:
        for r in _records(range(1, 7)):
            sink.write(r)
    with MetricsSink(tmp_path / "m.jsonl", tensorboard_dir=tb, log_every=2) as sink:
        sink.truncate_after(2)
        for r in _records(range(3, 7), loss0=40.0):
            sink.write(r)
    acc = EventAccumulator(str(tb))
    acc.Reload()
    assert {"train/loss", "train/acc_1", "train/tokens_per_s"} <= set(acc.Tags()["scalars"])
    loss = {e.step: e.value for e in acc.Scalars("train/loss")}
    # Step 2 from the first run; steps 4 and 6 from the resumed run (the first run's were purged).
    assert sorted(loss) == [2, 4, 6]
    assert loss[2] == pytest.approx(2.0)
    assert loss[4] == pytest.approx(10.0) and loss[6] == pytest.approx(40.0 / 6)


def test_summary_markdown_headline_and_curve():
    records = _records(range(1, 101))
    records[49] |= {"skipped": 1, "loss": None}
    records[-1] |= {"simulated_acc_len": 1.625, "mfu": 0.42}
    md = summary_markdown(records, title="EAGLE-3 training", curve_points=10)
    assert md.startswith("# EAGLE-3 training\n")
    assert "| first loss | 4.0000 (step 1) |" in md
    assert "| last loss | 0.0400 (step 100) |" in md
    assert "| best loss | 0.0400 (step 100) |" in md
    assert "| final per-slot acc | 0.500 / 0.250 |" in md
    assert "| simulated acc_len | 1.625 |" in md
    assert "| tokens/s (mean) | 1,000 |" in md
    assert "| MFU (mean) | 42.00% |" in md
    assert "| skipped steps | 1 |" in md
    curve = md.split("## Loss curve")[1].strip().splitlines()[2:]
    assert 10 <= len(curve) <= 11 and curve[0] == "| 1 | 4.0000 |" and curve[-1] == "| 100 | 0.0400 |"
    assert summary_markdown([], title="t") == "# t\n\nNo training steps were recorded.\n"
    json.dumps(records)  # the records the summary reads are plain JSON
