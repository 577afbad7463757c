"""How far a long stage has got: a Prefect progress artifact inside a Prefect run, a tqdm bar on a terminal.

Stage functions stay Prefect-free: they make a `Progress` with `stage_progress` and call `update` or
`advance` as often as they like (per sample, per step). The same calls feed two sinks, each of which may be
absent:

- Prefect: outside a flow or task run, or when the run's API is unreachable, a no-op. Inside one, the
  artifact is created at 0 % when the stage starts and updated at most once per `MIN_INTERVAL_S`, plus the
  final 100 % from `finish`, so a stage that reports per token costs the API one request every two seconds.
- Terminal: a tqdm bar on stderr (done/total, unit, rate, ETA), opened at the first update, so a resumed
  stage's rate and ETA count this run's work only. `DRAFTSMITH_PROGRESS` says when: `auto` (the default)
  when stderr is a TTY, `always`, or `never`. Nothing is written at all without a bar, and never from a
  torchrun rank: the launching process follows the ranks' log and shows the bar. While a bar is open,
  console log lines are written above it instead of through it.

Updates may come from any thread (training reports from the thread reading torchrun's output): the Prefect
calls run in a copy of the creating thread's context, which holds the run and the API settings.
"""

import contextvars
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import TextIO, TypeGuard, cast
from uuid import UUID

from tqdm import tqdm

from draftsmith.core import ui

log = logging.getLogger(__name__)
MIN_INTERVAL_S = 2.0
MODE_ENV = "DRAFTSMITH_PROGRESS"
MODES = ("auto", "always", "never")

Sink = Callable[[float], None]
_warned_modes: set[str] = set()


def _warn_bad_mode(value: str) -> None:
    if value not in _warned_modes:  # once per process, not once per stage
        _warned_modes.add(value)
        log.warning("%s=%r: expected one of %s; using auto", MODE_ENV, value, ", ".join(MODES))


def shows_bar(stream: TextIO) -> bool:
    """Whether a progress bar goes to `stream`: by `DRAFTSMITH_PROGRESS`, never from a torchrun rank."""
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return False
    mode = os.environ.get(MODE_ENV, "").strip().lower() or "auto"
    if mode not in MODES:
        _warn_bad_mode(mode)
        mode = "auto"
    if mode != "auto":
        return mode == "always"
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False


def _reports_size(stream: TextIO) -> bool:
    """Whether `stream` is a terminal that reports its height: tqdm draws nothing on one that says 0 rows
    (a pty nobody gave a size, as `script` opens one)."""
    try:
        return os.get_terminal_size(stream.fileno()).lines > 0
    except (AttributeError, ValueError, OSError):
        return False


def _count(x: float) -> float:
    """Whole numbers as ints, so the bar reads `3/10`, not `3.0/10`."""
    return int(x) if float(x).is_integer() else x


class _AroundBars(logging.Handler):
    """Stands in for a console handler while bars are open: clears them, lets it write, redraws them."""

    def __init__(self, inner: logging.StreamHandler) -> None:
        super().__init__()
        self.inner = inner

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno < self.inner.level:
            return
        try:
            with tqdm.external_write_mode(file=self.inner.stream):
                self.inner.handle(record)
        except Exception:  # as logging's own handlers: report, never raise into the caller
            self.handleError(record)


class _LogRouting:
    """Console handlers of the root logger go through `_AroundBars` while at least one bar is open.

    Open bars are held weakly: one whose `Progress` was dropped unfinished stops counting at the next close
    (until then the stand-ins stay, which costs only a clear and a redraw of no bars per line)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: weakref.WeakSet[Progress] = weakref.WeakSet()

    @staticmethod
    def _on_screen(handler: logging.Handler, bar_stream: TextIO) -> TypeGuard[logging.StreamHandler]:
        if not isinstance(handler, logging.StreamHandler) or isinstance(handler, logging.FileHandler):
            return False
        stream = handler.stream
        if stream in (bar_stream, sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            return True
        try:
            return bool(stream.isatty())
        except (AttributeError, ValueError, OSError):
            return False

    def opened(self, owner: "Progress", bar_stream: TextIO) -> None:
        with self._lock:
            self._open.add(owner)
            # Every time, not only for the first bar: a handler may have been added since (Prefect's, at import).
            root = logging.getLogger()
            root.handlers = [_AroundBars(h) if self._on_screen(h, bar_stream) else h for h in root.handlers]

    def closed(self, owner: "Progress") -> None:
        with self._lock:
            self._open.discard(owner)
            if not self._open:
                root = logging.getLogger()
                root.handlers = [h.inner if isinstance(h, _AroundBars) else h for h in root.handlers]


_routing = _LogRouting()


class Progress:
    """`done` of `total` units: a percentage to `sink` (None: none), throttled, and a bar on a terminal."""

    def __init__(
        self,
        total: float | None,
        sink: Sink | None = None,
        *,
        desc: str = "",
        unit: str = "it",
        stream: TextIO | None = None,
        min_interval_s: float = MIN_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`total` None: not known yet (`set_total` later); the stage shows 0 % until then.

        `desc` and `unit` (singular, as tqdm's rate reads `3.20prompt/s`) label the bar; `stream` is where it
        goes (default: stderr at the first update).
        """
        self.done = 0.0
        self.desc, self.unit = desc, unit
        self._lock = threading.Lock()
        self._stream = stream
        self._bar: tqdm | None = None
        self._bar_state = "unopened"  # then "open", or "none" (no terminal, closed, or broken)
        self._postfix = ""
        self.total: float | None = None
        self.set_total(total)
        self._sink = sink
        self._interval = min_interval_s
        self._clock = clock
        # A sink's artifact starts at 0 %, shown when it was created: that counts as the first update.
        self._last_sent_at: float | None = clock() if sink is not None else None
        self._last_sent: float | None = 0.0 if sink is not None else None

    @property
    def enabled(self) -> bool:
        """Whether updates still reach a Prefect artifact."""
        return self._sink is not None

    def percent(self) -> float:
        """`done / total` in percent, within [0, 100]; an empty stage (total 0) is done from the start."""
        if self.total is None:
            return 0.0
        if self.total <= 0:
            return 100.0
        return max(0.0, min(100.0, 100.0 * self.done / self.total))

    def set_total(self, total: float | None) -> None:
        """The total, once it is known (training learns its step count from the trainer)."""
        if total is not None and total < 0:
            raise ValueError(f"Progress.total: must be >= 0, got {total}")
        self.total = total
        with self._lock:
            if self._bar is not None:
                self._draw()

    def update(self, done: float) -> None:
        """`done` units are finished (absolute)."""
        self.done = done
        with self._lock:
            self._draw()
        if self._sink is not None:
            self._send(force=False)

    def advance(self, n: float = 1) -> None:
        """`n` more units are finished."""
        self.update(self.done + n)

    def note(self, text: str) -> None:
        """A short remark after the bar's rate (the pass an evaluation is in, the last loss); not sent to Prefect."""
        with self._lock:
            self._postfix = text
            if self._bar is not None:
                self._bar.set_postfix_str(text, refresh=False)

    def finish(self) -> None:
        """The stage completed: report 100 %, whatever the throttle says, and close the bar."""
        self.done = max(self.done, self.total or 0.0)
        self.total = self.total if self.total is not None else self.done
        with self._lock:
            self._draw()
            self._close_bar()
        if self._sink is not None:
            self._send(force=True)

    def close(self) -> None:
        """Close the bar where it stands (the stage failed); the Prefect artifact keeps its last value."""
        with self._lock:
            self._close_bar()

    def _draw(self) -> None:
        """Bring the bar to `done` of `total`, opening it at the first call; the caller holds the lock."""
        try:
            if self._bar_state == "unopened":
                self._open_bar()
                return
            bar = self._bar
            if bar is None:
                return
            total = None if self.total is None else _count(self.total)
            retotalled = bar.total != total
            bar.total = total
            if self.done != bar.n:
                bar.update(_count(self.done - bar.n))  # tqdm's own throttle: at most one redraw per 0.1 s
            if retotalled:
                bar.refresh()
        except Exception as err:  # see _send
            self._close_bar()
            log.warning("progress: the terminal bar failed (%s); no further bar", err)

    def _open_bar(self) -> None:
        stream = self._stream if self._stream is not None else sys.stderr
        if not shows_bar(stream):
            self._bar_state = "none"
            return
        sized = _reports_size(stream)
        self._bar = tqdm(
            total=None if self.total is None else _count(self.total),
            initial=_count(self.done),
            desc=self.desc or None,
            unit=self.unit,
            file=stream,
            # Follow the window's width as it is resized; without a reported size, a classic 80 x 24.
            dynamic_ncols=sized,
            ncols=None if sized else 80,
            nrows=None if sized else 24,
            miniters=0,  # every update checks the clock: a rate that drops must not freeze the bar
            postfix=self._postfix or None,
        )
        self._bar_state = "open"
        _routing.opened(self, stream)

    def _close_bar(self) -> None:
        bar, self._bar, self._bar_state = self._bar, None, "none"
        if bar is not None:
            try:
                bar.close()
            except Exception:  # a closed terminal; the stage goes on
                pass
            _routing.closed(self)

    def _send(self, *, force: bool) -> None:
        with self._lock:
            sink, now, value = self._sink, self._clock(), round(self.percent(), 1)
            if sink is None or value == self._last_sent:
                return
            recent = self._last_sent_at is not None and now - self._last_sent_at < self._interval
            if recent and not (force and value >= 100.0):
                return
            self._last_sent_at, self._last_sent = now, value
            try:
                sink(value)
            except Exception as err:  # a progress bar must never fail the stage it describes
                log.warning("progress: the Prefect API refused an update (%s); no further updates", err)
                self._sink = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None):
        if exc_type is None:
            self.finish()
        else:
            self.close()


def prefect_sink(key: str, description: str) -> Sink | None:
    """A sink updating a new progress artifact `key` (created now, at 0 %), or None outside a Prefect run."""
    if not ui.in_prefect_run():
        return None
    from prefect.artifacts import create_progress_artifact, update_progress_artifact

    try:
        # Called synchronously, it returns the id, not a coroutine.
        artifact_id = cast(UUID, create_progress_artifact(0.0, key=ui.artifact_key(key), description=description))
    except Exception as err:  # see Progress._send
        log.warning("progress: could not create the %s progress artifact (%s)", key, err)
        return None
    context = contextvars.copy_context()

    def sink(percent: float) -> None:
        # The Progress lock serialises calls, so this one context is never entered twice at once.
        context.run(update_progress_artifact, artifact_id, percent)

    return sink


def stage_progress(stage: str, out_uri: str, total: float | None, description: str, *, unit: str) -> Progress:
    """The progress of `stage` writing into `out_uri` (`<run_dir>/<stage>`): artifact `<run>-<stage>-progress`,
    and a bar named after the stage counting `unit`s (singular: `prompt`, `sample`, `step`)."""
    key = ui.artifact_key(ui.run_label(out_uri, parent=True), stage, "progress")
    return Progress(total, prefect_sink(key, description), desc=stage, unit=unit)
