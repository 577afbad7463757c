"""Prefect cache keys that also check a stage's artifacts still exist.

A key made of inputs and source alone would happily replay a manifest whose files were deleted or
changed. Here, no valid manifest on disk (every file present with its recorded size and digest) means no
key at all (the task runs), and a valid one folds its own key and file digests in. So the first rerun
after a stage completes runs the task body, which finds the valid manifest on disk and returns it without
work; later reruns are Prefect cache hits.

Each stage task run is named `<task>[<run>]` and, when its body runs, publishes the stage's markdown
summary (`draftsmith.ui`). The summary wrapper keeps the stage function's identity (`functools.wraps`, and
Prefect's `__prefect_task_source__`), so the key's `inspect.getsource` still reads the function itself.
"""

import functools
import hashlib
import inspect
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from prefect import task
from pydantic import BaseModel

from draftsmith import storage, ui
from draftsmith.manifest import StageManifest
from draftsmith.retry import RETRIES, RETRY_DELAYS, transient_only
from draftsmith.stage import load_manifest


def _param_fingerprint(value: Any) -> str:
    if isinstance(value, BaseModel):
        return value.model_dump_json()
    return repr(value)


def artifact_cache_key(stage: str) -> Callable[[Any, dict[str, Any]], str | None]:
    """A `cache_key_fn` for the task of `stage`, whose stage folder is `<run_dir>/<stage>`."""

    def key_fn(context: Any, parameters: dict[str, Any]) -> str | None:
        manifest = load_manifest(storage.join(parameters["run_dir"], stage))
        if manifest is None or not manifest.artifacts_present():
            return None
        h = hashlib.sha256(stage.encode())
        h.update(inspect.getsource(context.task.fn).encode())
        for name in sorted(parameters):
            h.update(f"\0{name}={_param_fingerprint(parameters[name])}".encode())
        h.update(manifest.key.encode())
        h.update(",".join(f.digest for f in manifest.files).encode())
        return h.hexdigest()

    return key_fn


def summarised(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, publishing the summary of the StageManifest it returns (inside a Prefect run)."""

    @functools.wraps(fn)
    def run_and_summarise(*args: Any, **kwargs: Any) -> Any:
        started_at = datetime.now(UTC)
        result = fn(*args, **kwargs)
        if isinstance(result, StageManifest):
            ui.publish_summary(result, started_at=started_at)
        return result

    # Prefect derives the task key from the code of `__prefect_task_source__` when it is the wrapped function.
    run_and_summarise.__prefect_task_source__ = fn  # type: ignore[attr-defined]
    return run_and_summarise


def stage_task(name: str, stage: str) -> Callable[[Callable[..., Any]], Any]:
    """The `@task` every stage wrapper uses: artifact-checked caching, transient-only retries, runs named
    `name[<run>]` after the `run_dir` parameter, and a summary artifact per executed stage."""

    def decorate(fn: Callable[..., Any]) -> Any:
        return task(
            name=name,
            task_run_name=ui.task_run_namer(name),
            cache_key_fn=artifact_cache_key(stage),
            persist_result=True,
            retries=RETRIES,
            retry_delay_seconds=RETRY_DELAYS,
            retry_condition_fn=transient_only,
        )(summarised(fn))

    return decorate
