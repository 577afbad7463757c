"""The small typed records that stages hand each other: URIs, counts, hashes. Never tensors.

A manifest names its files relative to its own stage folder and is bound to the folder it is read from
(`load_manifest`), so a copied or moved run folder describes, and is checked against, its own files.
Each file carries a content digest and the algorithm that made it: new entries use a fast hash (xxh3-128
when `xxhash` is installed, else BLAKE2b), entries written before that keep their sha256.
"""

import hashlib
import os
import time
from collections.abc import Callable
from datetime import UTC, datetime
from types import ModuleType
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from draftsmith.core import storage

xxhash: ModuleType | None
try:
    import xxhash
except ImportError:  # pragma: no cover - xxhash arrives with `datasets`; BLAKE2b keeps verification working
    xxhash = None

HASHERS: dict[str, Callable[[], Any]] = {
    "sha256": hashlib.sha256,
    "blake2b-128": lambda: hashlib.blake2b(digest_size=16),
}
if xxhash is not None:
    HASHERS["xxh3_128"] = xxhash.xxh3_128
FAST_HASH = "xxh3_128" if xxhash is not None else "blake2b-128"
_CHUNK = 16 << 20
_SETTLED_NS = 2_000_000_000


def digest(data: bytes, algo: str = FAST_HASH) -> str:
    h = HASHERS[algo]()
    h.update(data)
    return h.hexdigest()


# (path, algo) -> (stat signature, digest) of local files hashed by this process: a rerun checks a stage
# in its cache key and again in its body, and the second look should not re-read gigabytes.
_SEEN: dict[tuple[str, str], tuple[tuple[int, int, int], str]] = {}


def digest_file(url: str, algo: str) -> str:
    """Digest of the file at `url`, streamed in chunks so a multi-GB shard never sits in memory."""
    fs, path = storage.filesystem(url)
    stamp = None
    if storage.is_local(url):
        st = os.stat(path)
        stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
        seen = _SEEN.get((path, algo))
        if seen is not None and seen[0] == stamp:
            return seen[1]
    h = HASHERS[algo]()
    with fs.open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    # A file changed within the filesystem's timestamp tick of its hashing could keep its stamp ("racy git").
    if stamp is not None and time.time_ns() - stamp[2] > _SETTLED_NS:
        _SEEN[(path, algo)] = (stamp, h.hexdigest())
    return h.hexdigest()


class FileEntry(BaseModel):
    """One artifact of a stage, relative to the stage folder."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="Path relative to the stage folder.")
    bytes: int = Field(ge=0, description="Size in bytes.")
    digest: str = Field(description="Content hash, hex.")
    algo: str = Field("sha256", description="Algorithm of `digest` (sha256, xxh3_128, blake2b-128).")

    @model_validator(mode="before")
    @classmethod
    def _legacy_sha256(cls, data: Any) -> Any:
        # Manifests (and callers) from before `digest`/`algo` name a sha256 digest `sha256`.
        if isinstance(data, dict) and "sha256" in data:
            data = dict(data)
            data.setdefault("digest", data.pop("sha256"))
            data.setdefault("algo", "sha256")
            data.pop("sha256", None)
        return data

    def problem(self, url: str) -> str | None:
        """Why the file at `url` is not this artifact (missing, size, content), or None when it is."""
        try:
            size = storage.size(url)
        except FileNotFoundError:
            return f"{url}: missing"
        if size != self.bytes:
            return f"{url}: {size} bytes where {self.bytes} were recorded"
        if self.algo not in HASHERS:
            return f"{url}: cannot check its {self.algo} digest here (install xxhash)"
        got = digest_file(url, self.algo)
        if got != self.digest:
            return f"{url}: {self.algo} {got[:16]}… where {self.digest[:16]}… was recorded"
        return None


class StageManifest(BaseModel):
    """What a stage produced. It is written last, so its presence means the stage completed."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    stage: str = Field(description="Stage name.")
    key: str = Field(description="Hash of the stage's code, config and upstream manifests.")
    uri: str = Field(description="Stage folder (local path or fsspec URL); '.' on disk, bound when read.")
    files: list[FileEntry] = Field(default_factory=list, description="Artifacts with sizes and hashes.")
    counts: dict[str, int] = Field(default_factory=dict, description="Rows, tokens, drops per reason...")
    metrics: dict[str, float] = Field(default_factory=dict, description="Measured figures.")
    info: dict[str, str] = Field(default_factory=dict, description="Provenance (engine, model, hashes).")
    seconds: float = Field(0.0, ge=0.0, description="Wall time of the stage's own work.")
    created_at: str = Field(default_factory=lambda: datetime.now(UTC).isoformat(), description="UTC time.")

    def path(self, name: str) -> str:
        """URL of one artifact."""
        return storage.join(self.uri, name)

    def names(self, prefix: str = "") -> list[str]:
        return [f.name for f in self.files if f.name.startswith(prefix)]

    def problem(self) -> str | None:
        """The first recorded artifact that is missing or differs from its record, as one line; None if all match."""
        for f in self.files:
            found = f.problem(self.path(f.name))
            if found is not None:
                return found
        return None

    def artifacts_present(self) -> bool:
        """Every recorded artifact still exists with its recorded size and content hash."""
        return self.problem() is None

    def bound_to(self, stage_uri: str) -> "StageManifest":
        """This manifest describing the folder `stage_uri` (where it was read from), names made relative."""
        recorded = self.uri.rstrip("/") + "/"
        files = [f.model_copy(update={"name": f.name.removeprefix(recorded)}) for f in self.files]
        return self.model_copy(update={"uri": stage_uri, "files": files})

    def to_disk(self) -> dict:
        """The JSON written as `manifest.json`: no absolute location, so the folder can be copied or moved."""
        return self.model_dump(mode="json") | {"uri": "."}


def file_entry(stage_uri: str, name: str, data: bytes) -> FileEntry:
    """Write an artifact atomically and describe it."""
    storage.write_bytes(storage.join(stage_uri, name), data)
    return entry(name, data)


def entry(name: str, data: bytes) -> FileEntry:
    """The record of artifact `name` holding `data` (hashed once, here, with the fast hash)."""
    return FileEntry(name=name, bytes=len(data), digest=digest(data), algo=FAST_HASH)
