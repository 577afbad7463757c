"""Prefect cache keys made from the stage's own key, so Prefect and the stage agree on "current".

Every stage module defines `<stage>_key(...)` with its task's parameters (all but `run_dir`); the stage
function runs under that key (`draftsmith.core.stage.run_stage`) and the task's Prefect cache key is that same
key, checked by `valid_manifest` (every file present with its recorded size and digest) and extended with
the stage folder's location and the manifest itself (its files' digests, counts, seconds, created_at). No
current manifest on disk means no key at all (the task runs). So the first rerun after a stage completes
runs the task body, which finds the current manifest and returns it without work; later reruns are Prefect
cache hits, and a hit returns exactly the manifest in that folder. Without the location, a second run
folder holding the same results (a copy, or the same recipe run again elsewhere) would get the first
folder's manifest back, and its later stages would read the first folder's files. The dispatch of a stage
to another pool asks the same question through the task's `stage_key` attribute.

Each stage task run is named `<task>[<run>]` and, when its body runs, publishes the stage's markdown
summary (`draftsmith.core.ui`).
"""

import functools
import hashlib
import json
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Protocol, cast

from prefect import task

from draftsmith.core import storage, ui
from draftsmith.core.manifest import StageManifest
from draftsmith.core.retry import RETRIES, RETRY_DELAYS, transient_only
from draftsmith.core.stage import valid_manifest

KeyFn = Callable[..., str]


def folder_identity(stage_uri: str) -> str:
    """Where a stage folder is, independent of the working directory: a resolved path, or the URL."""
    if storage.is_local(stage_uri):
        return str(storage.local_path(stage_uri).resolve())
    return stage_uri


def manifest_cache_key(manifest: StageManifest, stage_uri: str) -> str:
    """The Prefect cache key of the valid `manifest` read from `stage_uri`: one per folder and materialisation."""
    h = hashlib.sha256(manifest.key.encode())
    h.update(b"\0" + folder_identity(stage_uri).encode())
    h.update(b"\0" + json.dumps(manifest.to_disk(), sort_keys=True).encode())
    return h.hexdigest()


def artifact_cache_key(stage: str, key_of: KeyFn) -> Callable[[Any, dict[str, Any]], str | None]:
    """A `cache_key_fn` for the task of `stage`, whose stage folder is `<run_dir>/<stage>` and whose stage
    key is `key_of(**parameters without run_dir)`."""

    def key_fn(context: Any, parameters: dict[str, Any]) -> str | None:
        args = {name: value for name, value in parameters.items() if name != "run_dir"}
        stage_uri = storage.join(parameters["run_dir"], stage)
        manifest = valid_manifest(stage_uri, key_of(**args), quiet=True)
        if manifest is None:
            return None
        return manifest_cache_key(manifest, stage_uri)

    return key_fn


class StageTask(Protocol):
    """A stage's Prefect task, which also carries its stage key function (`stage_task`)."""

    stage_key: Callable[..., str]

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...


def summarised(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, publishing the summary of the StageManifest it returns (inside a Prefect run)."""

    @functools.wraps(fn)
    def run_and_summarise(*args: Any, **kwargs: Any) -> Any:
        started_at = datetime.now(UTC)
        result = fn(*args, **kwargs)
        if isinstance(result, StageManifest):
            ui.publish_summary(result, started_at=started_at)
        return result

    return run_and_summarise


def stage_task(name: str, stage: str, key: KeyFn) -> Callable[[Callable[..., Any]], Any]:
    """The `@task` every stage wrapper uses: cached by the stage key `key` (same parameters as the task but
    `run_dir`) and the artifacts' integrity, transient-only retries, runs named `name[<run>]` after the
    `run_dir` parameter, and a summary artifact per executed stage. The task carries `key` as `stage_key`."""

    def decorate(fn: Callable[..., Any]) -> Any:
        wrapped = task(
            name=name,
            task_run_name=ui.task_run_namer(name),
            cache_key_fn=artifact_cache_key(stage, key),
            persist_result=True,
            retries=RETRIES,
            retry_delay_seconds=RETRY_DELAYS,
            retry_condition_fn=transient_only,
        )(summarised(fn))
        cast(StageTask, wrapped).stage_key = key
        return wrapped

    return decorate
