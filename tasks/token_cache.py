"""Per-shard token cache: a rerun with one changed shard re-tokenizes only that shard.

An entry is keyed by everything its bytes depend on: the shard's content hash, a hash of the tokenizer
files, the template the renderer reproduces, the options that shape samples and the code that made them.
It lives outside the stage folder, which `run_stage` clears whenever the stage's inputs change. An entry
is the packed token shard plus a JSON summary (counts, rejects) written after it, so a torn write is a miss.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from draftsmith.core import storage

log = logging.getLogger(__name__)

# Files that decide how text becomes ids; weights and configs do not.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
)


def tokenizer_sha256(folder: str | Path) -> str:
    """sha256 over the tokenizer files present in a model folder (name and content of each)."""
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = Path(folder) / name
        if path.is_file():
            h.update(name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


def entry_key(*, data_sha256: str, tokenizer: str, template: str, options: dict[str, Any], code: str) -> str:
    """The cache key of one shard's tokenized output."""
    blob = json.dumps(
        {"data": data_sha256, "tokenizer": tokenizer, "template": template, "options": options, "code": code},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


class TokenCache:
    """Entries under `uri` (local or fsspec); `uri=None` disables the cache."""

    def __init__(self, uri: str | None) -> None:
        self.uri = uri

    def get(self, key: str) -> tuple[bytes, dict[str, Any]] | None:
        """The packed shard and its summary, or None on a miss (absent, torn or size-mismatched entry)."""
        if self.uri is None:
            return None
        meta_url, data_url = self._urls(key)
        try:
            summary = storage.read_json(meta_url)
            data = storage.read_bytes(data_url)
        except (FileNotFoundError, ValueError):
            return None
        if len(data) != summary.get("bytes") or storage.sha256(data) != summary.get("sha256"):
            log.warning("token cache entry %s is damaged; re-tokenizing its shard", key[:12])
            return None
        return data, summary

    def put(self, key: str, data: bytes, summary: dict[str, Any]) -> None:
        if self.uri is None:
            return
        meta_url, data_url = self._urls(key)
        storage.write_bytes(data_url, data)
        storage.write_json(meta_url, {**summary, "bytes": len(data), "sha256": storage.sha256(data)})

    def _urls(self, key: str) -> tuple[str, str]:
        assert self.uri is not None, "callers return early without a cache folder"
        return storage.join(self.uri, f"{key}.json"), storage.join(self.uri, f"{key}.safetensors")
