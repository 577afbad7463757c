"""Stage bookkeeping: content keys, resume from a valid manifest, the manifest as the commit point.

A stage folder holds its artifacts, a `.stage-key` naming the inputs its partial work belongs to, and
`manifest.json`, written last. A rerun with the same key returns the manifest without work; a rerun
after a crash keeps the finished shards (stages resume shard by shard); a rerun with a different key
starts the folder afresh, because its partial work answers other inputs.

A manifest is current only while every file it lists has its recorded size and content digest; a file
that differs is named in one log line and the stage is recomputed (resumable stages re-check their own
committed shards). Downstream keys fold in upstream digests, so they follow a recomputed upstream only
when its content changed.
"""

import hashlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from pydantic import BaseModel

from draftsmith.core import runlock, storage
from draftsmith.core.codehash import code_digest
from draftsmith.core.manifest import FileEntry, StageManifest

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
KEY_FILE = ".stage-key"


@dataclass
class StageResult:
    """What a stage's compute function returns; `run_stage` turns it into the manifest."""

    files: list[FileEntry]
    counts: dict[str, int] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    info: dict[str, str] = field(default_factory=dict)


def _fingerprint(value: Any) -> str:
    if isinstance(value, StageManifest):
        # Content, not timestamps: a recomputed but identical upstream keeps downstream keys stable.
        return value.key + ":" + ",".join(f.digest for f in value.files)
    if isinstance(value, BaseModel):
        return value.model_dump_json()
    return repr(value)


def stage_key(stage: str, code: Iterable[ModuleType], **inputs: Any) -> str:
    """The one key of a stage's result: the stage name, the code it runs (`code` and every project module
    they import, `codehash.code_digest`) and its inputs (config sections, upstream manifests' keys and
    digests, source fingerprints). The stage bookkeeping, the Prefect cache key and the dispatch of a stage
    to another pool all compare this key and then `valid_manifest`."""
    h = hashlib.sha256(stage.encode())
    h.update(code_digest(code).encode())
    for name in sorted(inputs):
        h.update(f"\0{name}=".encode() + _fingerprint(inputs[name]).encode())
    return h.hexdigest()


class IntegrityError(ValueError):
    """A finished stage's file no longer matches its manifest (the message names the file)."""


def load_manifest(stage_uri: str) -> StageManifest | None:
    """The manifest in `stage_uri`, describing the files there (wherever it was first written)."""
    url = storage.join(stage_uri, MANIFEST)
    if not storage.exists(url):
        return None
    return StageManifest.model_validate(storage.read_json(url)).bound_to(stage_uri)


def valid_manifest(stage_uri: str, key: str, *, quiet: bool = False) -> StageManifest | None:
    """The finished manifest for `key`, if its artifacts are all still there with their recorded content.

    This is the one test of "is this stage's result current": same key, every listed file present with its
    recorded size and digest (re-hashed, not just sized). A mismatch is logged naming the file, unless
    `quiet` (the Prefect cache key asks first; the stage body then logs it once).
    """
    manifest = load_manifest(stage_uri)
    if manifest is None or manifest.key != key:
        return None
    problem = manifest.problem()
    if problem is not None:
        if not quiet:
            log.warning("%s: %s; recomputing the stage", manifest.stage, problem)
        return None
    return manifest


def verify_stage(stage_uri: str) -> StageManifest | None:
    """The manifest of `stage_uri` after checking its files (None when the folder holds no manifest).

    Raises `IntegrityError` naming the first file that is missing or differs from its record, so a tool
    that uses the files (export, eval) never works from a silently damaged checkpoint.
    """
    manifest = load_manifest(stage_uri)
    if manifest is None:
        return None
    problem = manifest.problem()
    if problem is not None:
        raise IntegrityError(f"{problem} (does not match {storage.join(stage_uri, MANIFEST)})")
    return manifest


def _prepare_folder(stage_uri: str, key: str) -> None:
    key_url = storage.join(stage_uri, KEY_FILE)
    if storage.exists(key_url) and storage.read_bytes(key_url).decode() != key:
        log.warning("%s: inputs changed since the partial work here; starting this stage afresh", stage_uri)
        storage.remove_tree(stage_uri)
    elif storage.exists(storage.join(stage_uri, MANIFEST)):
        # A finished manifest for other inputs, or one whose artifacts went missing.
        storage.remove_tree(storage.join(stage_uri, MANIFEST))
    storage.makedirs(stage_uri)
    storage.write_bytes(key_url, key.encode())


def run_stage(stage: str, stage_uri: str, key: str, compute: Callable[[str], StageResult]) -> StageManifest:
    """Return the stage's manifest, computing (or resuming) it only when needed."""
    start = time.perf_counter()
    done = valid_manifest(stage_uri, key)
    if done is not None:
        size = sum(f.bytes for f in done.files) / 1e6
        took = time.perf_counter() - start
        log.info(
            "%s: up to date (%s; %d files, %.1f MB verified in %.2f s)", stage, stage_uri, len(done.files), size, took
        )
        return done
    _prepare_folder(stage_uri, key)
    # A killed write leaves its temp file behind; the run holds the folder, so no live writer owns one.
    runlock.remove_stale_temps(stage_uri)
    start = time.perf_counter()
    result = compute(stage_uri)
    manifest = StageManifest(
        stage=stage,
        key=key,
        uri=stage_uri,
        files=result.files,
        counts=result.counts,
        metrics=result.metrics,
        info=result.info,
        seconds=round(time.perf_counter() - start, 3),
    )
    storage.write_json(storage.join(stage_uri, MANIFEST), manifest.to_disk())
    log.info("%s: done in %.1f s (%s)", stage, manifest.seconds, stage_uri)
    return manifest
