"""Step metrics without host syncs on the hot path, and where they go: JSONL, TensorBoard, the log, markdown.

`DeferredMetrics` reads each step's device-side metric vector one step late: step N's copy to the host is
queued behind step N's kernels and read after step N+1 is queued, so the host never waits for the step it is
launching. `MetricsSink` writes the records, `summary_markdown` turns them into a Prefect artifact.

Record keys the summary understands (others are written and plotted as they are): `step` (int, required),
`loss`, `acc_0 .. acc_{K-1}` (per-slot accuracy), `simulated_acc_len`, `tokens_per_s`, `mfu`, `skipped`
(1 for a step dropped for a non-finite loss or gradient).
"""

import json
import logging
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

_ACC = re.compile(r"^acc_(\d+)$")


class DeferredMetrics:
    """Turns a device vector `values[M]` per step into `{"step": s, name: float}` one step later."""

    def __init__(self, names: Sequence[str], device: torch.device) -> None:
        if not names:
            raise ValueError("DeferredMetrics: names must not be empty")
        if len(set(names)) != len(names) or "step" in names:
            raise ValueError(f"DeferredMetrics: names must be unique and not 'step', got {list(names)}")
        self.names = tuple(names)
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        # Two buffers: step N+1's copy lands in one while step N's (maybe still in flight) sits in the other.
        self._bufs = [torch.empty(len(self.names), dtype=torch.float32, pin_memory=cuda) for _ in range(2)]
        self._events: list[Any] = [None, None]
        self._next = 0
        self._pending: tuple[int, int] | None = None  # (step, buffer index)

    def push(self, step: int, values: torch.Tensor) -> dict | None:
        """Queue step `step`'s `values[M]` (any device/float dtype); return the previous step's record or None."""
        if values.dim() != 1 or values.shape[0] != len(self.names):
            raise ValueError(
                f"DeferredMetrics.push: values must have shape [{len(self.names)}] ({', '.join(self.names)}), "
                f"got {list(values.shape)}"
            )
        idx = self._next
        # Cast on the device (async there) so the host copy is a plain float32 D2H transfer.
        src = values.detach().to(dtype=torch.float32)
        if self.device.type == "cuda":
            self._bufs[idx].copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._events[idx] = event
        else:
            self._bufs[idx].copy_(src)
        previous, self._pending, self._next = self._pending, (step, idx), 1 - idx
        return self._read(previous) if previous is not None else None

    def flush(self) -> dict | None:
        """The last pushed step's record (waits for its copy), or None if nothing is pending."""
        previous, self._pending = self._pending, None
        return self._read(previous) if previous is not None else None

    def _read(self, pending: tuple[int, int]) -> dict:
        step, idx = pending
        event = self._events[idx]
        if event is not None:
            event.synchronize()  # waits for that one copy (queued a step ago), not for the whole stream
        return {"step": step, **dict(zip(self.names, self._bufs[idx].tolist(), strict=True))}


def read_jsonl(path: str | Path, *, tolerate_torn_tail: bool = False) -> list[dict]:
    """Records of a JSONL file; `tolerate_torn_tail` drops an unterminated last line (a crash mid-write)."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    torn = lines.pop()  # "" when the file ends with a newline
    records = []
    for lineno, line in enumerate(lines, start=1):
        if line.strip():
            records.append(_parse(path, lineno, line))
    if torn.strip() and not tolerate_torn_tail:
        records.append(_parse(path, len(lines) + 1, torn))
    return records


def _parse(path: Path, lineno: int, line: str) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{lineno}: not a JSON record ({e.msg}): {line[:80]!r}") from None
    if not isinstance(record, dict) or not isinstance(record.get("step"), int):
        raise ValueError(f"{path}:{lineno}: expected an object with an integer 'step', got {line[:80]!r}")
    return record


def _drop_torn_tail(path: Path) -> None:
    # A crash mid-write leaves an unterminated last line; appending to it would glue two records together.
    if not path.exists():
        return
    with path.open("r+b") as fh:
        data = fh.read()
        if data and not data.endswith(b"\n"):
            fh.truncate(data.rfind(b"\n") + 1)


def _finite_or_none(value: Any) -> Any:
    # JSON has no NaN/inf; a skipped step's non-finite loss is written as null.
    return None if isinstance(value, float) and not math.isfinite(value) else value


class MetricsSink:
    """Appends step records to a JSONL file, mirrors them to TensorBoard and logs a line every `log_every` steps."""

    def __init__(
        self,
        jsonl_path: str | Path,
        *,
        tensorboard_dir: str | Path | None = None,
        log_every: int = 20,
        logger: logging.Logger | None = None,
    ) -> None:
        if log_every < 1:
            raise ValueError(f"MetricsSink: log_every must be >= 1, got {log_every}")
        self.path = Path(jsonl_path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tensorboard_dir = Path(tensorboard_dir) if tensorboard_dir is not None else None
        self.log_every = log_every
        self.logger = logger or logging.getLogger(__name__)
        _drop_torn_tail(self.path)
        self._fh = self.path.open("a", encoding="utf-8")
        self._tb: Any = None  # SummaryWriter, opened on first use so a resume can set its purge step first
        self._purge_step: int | None = None

    def truncate_after(self, step: int) -> int:
        """Drop records with step > `step` (a resume from that checkpoint); returns how many were dropped.

        TensorBoard events past `step` are purged too (SummaryWriter's `purge_step`), so the resumed run's
        curves and JSONL hold each step once.
        """
        self._fh.close()
        records = read_jsonl(self.path, tolerate_torn_tail=True)
        kept = [r for r in records if r["step"] <= step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        with tmp.open("w", encoding="utf-8") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in kept)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)
        self._fh = self.path.open("a", encoding="utf-8")
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        self._purge_step = step + 1
        return len(records) - len(kept)

    def write(self, record: dict) -> None:
        """Append `record` (must hold an integer `step`); TensorBoard and the log on `log_every` steps."""
        step = record.get("step")
        if not isinstance(step, int):
            raise ValueError(f"MetricsSink.write: record needs an integer 'step', got {record!r}")
        clean = {k: _finite_or_none(v) for k, v in record.items()}
        self._fh.write(json.dumps(clean) + "\n")
        self._fh.flush()
        if step % self.log_every:
            return
        scalars = {k: v for k, v in record.items() if k != "step" and _is_number(v)}
        if self.tensorboard_dir is not None:
            writer = self._writer()
            for name, value in scalars.items():
                writer.add_scalar(f"train/{name}", float(value), step)
        self.logger.info("train step %d | %s", step, " ".join(f"{k} {_fmt(v)}" for k, v in scalars.items()))

    def _writer(self) -> Any:
        if self._tb is None:
            from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when enabled

            self._tb = SummaryWriter(str(self.tensorboard_dir), purge_step=self._purge_step)
        return self._tb

    def close(self) -> None:
        self._fh.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> "MetricsSink":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _fmt(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:.4g}"


def summary_markdown(records: list[dict], *, title: str, curve_points: int = 20) -> str:
    """A markdown report of a run: headline figures, then the loss every ~len/curve_points steps."""
    if not records:
        return f"# {title}\n\nNo training steps were recorded.\n"
    losses = [(r["step"], r["loss"]) for r in records if _is_number(r.get("loss"))]
    last = records[-1]
    rows: list[tuple[str, str]] = [("steps", str(last["step"]))]
    if losses:
        best = min(losses, key=lambda sl: sl[1])
        rows += [
            ("first loss", f"{losses[0][1]:.4f} (step {losses[0][0]})"),
            ("last loss", f"{losses[-1][1]:.4f} (step {losses[-1][0]})"),
            ("best loss", f"{best[1]:.4f} (step {best[0]})"),
        ]
    accs = sorted((int(m.group(1)), v) for k, v in last.items() if (m := _ACC.match(k)) and _is_number(v))
    if accs:
        rows.append(("final per-slot acc", " / ".join(f"{v:.3f}" for _, v in accs)))
    acc_len = last.get("simulated_acc_len", last.get("acc_len"))
    if _is_number(acc_len):
        rows.append(("simulated acc_len", f"{acc_len:.3f}"))
    for key, label, fmt in (("tokens_per_s", "tokens/s (mean)", "{:,.0f}"), ("mfu", "MFU (mean)", "{:.2%}")):
        values = [r[key] for r in records if _is_number(r.get(key))]
        if values:
            rows.append((label, fmt.format(sum(values) / len(values))))
    rows.append(("skipped steps", str(sum(1 for r in records if r.get("skipped")))))
    out = [f"# {title}", "", "| metric | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]
    if losses:
        stride = max(1, math.ceil(len(losses) / curve_points))
        picked = losses[::stride]
        if picked[-1] != losses[-1]:
            picked.append(losses[-1])
        out += ["", "## Loss curve", "", "| step | loss |", "|---|---|", *(f"| {s} | {v:.4f} |" for s, v in picked)]
    return "\n".join(out) + "\n"
