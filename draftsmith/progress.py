"""How far a long stage has got, as a Prefect progress artifact; nothing at all outside a Prefect run.

Stage functions stay Prefect-free: they make a `Progress` with `stage_progress` and call `update` or
`advance` as often as they like (per sample, per step). Outside a flow or task run, or when the run's API is
unreachable, every call is a no-op. Inside one, the artifact is created at 0 % when the stage starts and
updated at most once per `MIN_INTERVAL_S`, plus the final 100 % from `finish`, so a stage that reports per
token costs the API one request every two seconds, not thousands.

Updates may come from any thread (training reports from the thread reading torchrun's output): the Prefect
calls run in a copy of the creating thread's context, which holds the run and the API settings.
"""

import contextvars
import logging
import threading
import time
from collections.abc import Callable
from types import TracebackType

from draftsmith import ui

log = logging.getLogger(__name__)
MIN_INTERVAL_S = 2.0

Sink = Callable[[float], None]


class Progress:
    """`done` of `total` units, reported as a percentage to `sink` (None: a no-op), throttled."""

    def __init__(
        self,
        total: float | None,
        sink: Sink | None = None,
        *,
        min_interval_s: float = MIN_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`total` None: not known yet (`set_total` later); the stage shows 0 % until then."""
        self.total: float | None = None
        self.set_total(total)
        self.done = 0.0
        self._sink = sink
        self._interval = min_interval_s
        self._clock = clock
        # A sink's artifact starts at 0 %, shown when it was created: that counts as the first update.
        self._last_sent_at: float | None = clock() if sink is not None else None
        self._last_sent: float | None = 0.0 if sink is not None else None
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
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

    def update(self, done: float) -> None:
        """`done` units are finished (absolute)."""
        self.done = done
        if self._sink is not None:
            self._send(force=False)

    def advance(self, n: float = 1) -> None:
        """`n` more units are finished."""
        self.update(self.done + n)

    def finish(self) -> None:
        """The stage completed: report 100 %, whatever the throttle says."""
        self.done = max(self.done, self.total or 0.0)
        self.total = self.total if self.total is not None else self.done
        if self._sink is not None:
            self._send(force=True)

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
            except Exception as err:  # noqa: BLE001 - a progress bar must never fail the stage it describes
                log.warning("progress: the Prefect API refused an update (%s); no further updates", err)
                self._sink = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None):
        if exc_type is None:
            self.finish()


def prefect_sink(key: str, description: str) -> Sink | None:
    """A sink updating a new progress artifact `key` (created now, at 0 %), or None outside a Prefect run."""
    if not ui.in_prefect_run():
        return None
    from prefect.artifacts import create_progress_artifact, update_progress_artifact

    try:
        artifact_id = create_progress_artifact(0.0, key=ui.artifact_key(key), description=description)
    except Exception as err:  # noqa: BLE001 - see Progress._send
        log.warning("progress: could not create the %s progress artifact (%s)", key, err)
        return None
    context = contextvars.copy_context()

    def sink(percent: float) -> None:
        # The Progress lock serialises calls, so this one context is never entered twice at once.
        context.run(update_progress_artifact, artifact_id, percent)

    return sink


def stage_progress(stage: str, out_uri: str, total: float | None, description: str) -> Progress:
    """The progress of `stage` writing into `out_uri` (`<run_dir>/<stage>`): artifact `<run>-<stage>-progress`."""
    key = ui.artifact_key(ui.run_label(out_uri, parent=True), stage, "progress")
    return Progress(total, prefect_sink(key, description))
