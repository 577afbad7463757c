"""Prefect cache keys that also check a stage's artifacts still exist.

A key made of inputs and source alone would happily replay a manifest whose files were deleted. Here,
no valid manifest on disk means no key at all (the task runs), and a valid one folds its own key and
file hashes in. So the first rerun after a stage completes runs the task body, which finds the valid
manifest on disk and returns it without work; later reruns are Prefect cache hits.
"""

import hashlib
import inspect
from collections.abc import Callable
from typing import Any

from prefect import task
from pydantic import BaseModel

from draftsmith import storage
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
        h.update(",".join(f.sha256 for f in manifest.files).encode())
        return h.hexdigest()

    return key_fn


def stage_task(name: str, stage: str) -> Callable[[Callable[..., Any]], Any]:
    """The `@task` every stage wrapper uses: artifact-checked caching, transient-only retries."""
    return task(
        name=name,
        cache_key_fn=artifact_cache_key(stage),
        persist_result=True,
        retries=RETRIES,
        retry_delay_seconds=RETRY_DELAYS,
        retry_condition_fn=transient_only,
    )
