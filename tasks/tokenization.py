"""Stage 3: render conversations with the target's chat template and mark assistant tokens for loss.

Rendering and the render-boundary mask live in `tasks.renderers`; row validation in `draftsmith.tasks.token_rows`;
the per-shard cache in `draftsmith.tasks.token_cache`. Here: encoding with the length policy, the worker pool and the
stage. The pool starts before the corpus is read; each job is a chunk of raw JSONL lines that a worker
parses, renders (batched), tokenizes (batched) and returns as numpy bytes, so the parent only packs.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from draftsmith.core import runlock, storage, tensorio
from draftsmith.core.caching import stage_task
from draftsmith.core.codehash import code_digest
from draftsmith.core.config import TargetConfig, TokenizeConfig
from draftsmith.core.manifest import FileEntry, StageManifest, file_entry
from draftsmith.core.progress import Progress, stage_progress
from draftsmith.core.rejects import REJECTED_FILE, Rejects
from draftsmith.core.stage import StageResult, run_stage, stage_key
from draftsmith.core.target_setup import resolve_target
from draftsmith.tasks import renderers, token_cache, token_encode, token_rows
from draftsmith.tasks.renderers import assistant_spans
from draftsmith.tasks.token_encode import Encoded, Options, _init_worker, _process_job, encode
from draftsmith.transport.token_shards import read_token_shard

__all__ = ["Encoded", "Options", "assistant_spans", "encode", "pack_shard", "read_token_shard", "tokenize"]

log = logging.getLogger(__name__)
STAGE = "tokenize"


# ---- shards -----------------------------------------------------------------------------------------


def pack_shard(rows: list[tuple[dict, Encoded]]) -> bytes:
    """Concatenate samples into one safetensors blob: `input_ids` `[T]`, `loss_mask` `[T]`, `offsets` `[n+1]`."""
    lengths = np.asarray([len(e.input_ids) for _, e in rows], np.int64)
    ids = np.concatenate([e.input_ids for _, e in rows]) if rows else np.zeros(0, np.int32)
    mask = np.concatenate([e.loss_mask for _, e in rows]) if rows else np.zeros(0, np.uint8)
    return _pack_arrays(ids, mask, lengths, [r["id"] for r, _ in rows], [r["category"] for r, _ in rows])


def _pack_arrays(ids: np.ndarray, mask: np.ndarray, lengths: np.ndarray, row_ids: list, categories: list) -> bytes:
    """`ids` int32 `[T]`, `mask` uint8 `[T]`, `lengths` int64 `[n]` as a token shard."""
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tensors = {
        "input_ids": torch.from_numpy(np.ascontiguousarray(ids, np.int32)),
        "loss_mask": torch.from_numpy(np.ascontiguousarray(mask, np.uint8)),
        "offsets": torch.from_numpy(offsets),
    }
    return tensorio.dumps(tensors, {"ids": json.dumps(row_ids), "categories": json.dumps(categories)})


def _summarise(chunks: list[token_encode.Chunk]) -> tuple[bytes, dict[str, Any]]:
    """Pack the kept samples of one shard; count samples, tokens, truncations, drops and rejects."""
    # bytearray: torch wants writable buffers, and one copy per shard is cheap.
    lengths = np.frombuffer(b"".join(c.lengths for c in chunks), np.int64)
    ids = np.frombuffer(bytearray(b"".join(c.ids for c in chunks)), np.int32)
    mask = np.frombuffer(bytearray(b"".join(c.mask for c in chunks)), np.uint8)
    counts = {
        "samples": len(lengths),
        "tokens": len(ids),
        "loss_tokens": sum(c.loss_tokens for c in chunks),
        "truncated": sum(c.truncated for c in chunks),
    }
    for c in chunks:
        for reason, n in c.drops.items():
            counts[f"dropped.{reason}"] = counts.get(f"dropped.{reason}", 0) + n
    row_ids = [r for c in chunks for r in c.row_ids]
    categories = [r for c in chunks for r in c.categories]
    data = _pack_arrays(ids, mask, lengths, row_ids, categories)
    summary = {"rows": sum(c.rows for c in chunks), "counts": counts, "rejects": [r for c in chunks for r in c.rejects]}
    return data, summary


# ---- the stage --------------------------------------------------------------------------------------


def check_provenance(cfg: TokenizeConfig, corpus: dict[str, str], template_sha256: str) -> str:
    """Refuse a corpus rendered under another template or thinking mode; returns the check's outcome.

    Older corpora may lack the fields (unknown: a warning) or record a 16-hex prefix of the hash.
    """
    problems = []
    recorded = corpus.get("chat_template_sha256") or ""
    if not recorded:
        log.warning("tokenize: the corpus records no chat_template_sha256; the template match is unchecked")
    elif not template_sha256.startswith(recorded.lower()):
        problems.append(
            f"chat template sha256 {recorded} (corpus) != {template_sha256} (tokenize.renderer={cfg.renderer!r})"
        )
    thinking = corpus.get("thinking")
    if thinking is None:
        log.warning("tokenize: the corpus records no thinking mode; tokenize.thinking=%s is unchecked", cfg.thinking)
    elif thinking != cfg.thinking:
        problems.append(f"thinking {thinking!r} (corpus) != {cfg.thinking!r} (tokenize.thinking)")
    if not problems:
        return "checked" if recorded and thinking is not None else "unknown"
    message = "tokenize: the corpus does not match this stage: " + "; ".join(problems)
    if not cfg.allow_provenance_mismatch:
        raise ValueError(message + "; set tokenize.allow_provenance_mismatch: true to tokenize it anyway")
    log.warning("%s (allowed by tokenize.allow_provenance_mismatch)", message)
    return "mismatch_allowed"


def _sources(cfg: TokenizeConfig, conversations: StageManifest) -> list[tuple[str, str]]:
    """`(label, url)` of every input file: the regenerated shards in manifest order, then extra sources."""
    names = [n for n in conversations.names("conversations") if n.endswith(".jsonl")]
    out = [(n, conversations.path(n)) for n in names]
    for i, url in enumerate(cfg.extra_sources):
        if not storage.exists(url):
            raise ValueError(f"tokenize.extra_sources[{i}]: {url}: file not found")
        out.append((url, url))
    return out


def _source_fingerprint(url: str) -> str:
    fs, path = storage.filesystem(url)
    return fs.ukey(path) if fs.exists(path) else "missing"


def _cache_uri(cfg: TokenizeConfig, out_uri: str) -> str | None:
    if cfg.cache_uri is not None:
        return cfg.cache_uri or None
    own = storage.join(out_uri.rstrip("/").rsplit("/", 1)[0], ".cache", STAGE)
    # The run's own cache has the run's one writer: a killed write's temp file is ours to remove. A cache
    # named in the recipe may be shared by runs writing now, so it is left alone.
    runlock.remove_stale_temps(own)
    return own


_CODE = [sys.modules[__name__], renderers, token_rows, token_cache, token_encode]


@dataclass
class _Plan:
    """What every shard job needs from the parent: the cache and how entries are keyed."""

    cache: token_cache.TokenCache
    key_parts: dict[str, Any]
    chunk_size: int

    def key(self, data: bytes) -> str:
        return token_cache.entry_key(data_sha256=storage.sha256(data), **self.key_parts)


def _jobs(plan: _Plan, sources: list[tuple[str, str]], hits: dict[int, tuple], keys: dict[int, str]) -> Iterator:
    """Chunks of raw lines of every shard, read lazily; a cached shard is one empty job (the entry goes to `hits`)."""
    for s, (label, url) in enumerate(sources):
        data = storage.read_bytes(url)
        keys[s] = plan.key(data)
        entry = plan.cache.get(keys[s])
        if entry is not None:
            hits[s] = entry
            yield s, 0, 1, label, None
            continue
        lines = [(n, raw) for n, raw in enumerate(data.split(b"\n"), 1) if raw.strip()]
        n_chunks = max(1, -(-len(lines) // plan.chunk_size))
        for c in range(n_chunks):
            yield s, c, n_chunks, label, lines[c * plan.chunk_size : (c + 1) * plan.chunk_size]


def _run_jobs(
    plan: _Plan, sources: list[tuple[str, str]], pool: Any, uri: str, progress: Progress
) -> tuple[list[FileEntry], dict, Rejects]:
    """Tokenize every source into its shard; `progress` counts finished sources."""
    hits: dict[int, tuple] = {}
    keys: dict[int, str] = {}
    jobs = _jobs(plan, sources, hits, keys)
    results = pool.imap(_process_job, jobs) if pool is not None else map(_process_job, jobs)
    files: list[FileEntry] = []
    totals: dict[str, int] = {"rows": 0, "samples": 0, "tokens": 0, "loss_tokens": 0, "truncated": 0}
    rejects = Rejects(STAGE)
    pending: list[token_encode.Chunk] = []
    for s, chunk, n_chunks, out in results:
        if out is not None:
            pending.append(out)
        if chunk + 1 < n_chunks:
            continue
        cached = s in hits
        if cached:
            data, summary = hits.pop(s)
        else:
            data, summary = _summarise(pending)
            plan.cache.put(keys[s], data, summary)
        pending = []
        files.append(file_entry(uri, f"tokens-{s:05d}.safetensors", data))
        totals["rows"] += summary["rows"]
        for k, v in summary["counts"].items():
            totals[k] = totals.get(k, 0) + v
        for r in summary["rejects"]:
            rejects.add(
                source=sources[s][0],
                reason=r["reason"],
                detail=r["detail"],
                line=r["line"],
                row_id=r["id"],
                raw=r["excerpt"],
            )
        log.info("tokenize: %s: %d rows (%s)", sources[s][0], summary["rows"], "cached" if cached else "tokenized")
        progress.advance()
    return files, totals, rejects


def tokenize_key(cfg: TokenizeConfig, target: TargetConfig, conversations: StageManifest) -> str:
    """The stage key (`draftsmith.core.stage.stage_key`): config, target, conversations, the tokenizer's files
    and the extra sources' content."""
    tok_sha = token_cache.tokenizer_sha256(str(resolve_target(target.source, tokenizer_only=True)))
    extra = [_source_fingerprint(u) for u in cfg.extra_sources]
    return stage_key(STAGE, _CODE, cfg=cfg, target=target, conversations=conversations, tokenizer=tok_sha, extra=extra)


def tokenize(cfg: TokenizeConfig, target: TargetConfig, conversations: StageManifest, *, out_uri: str) -> StageManifest:
    """Write one `tokens-NNNNN.safetensors` per input file and `rejected.jsonl`; counts by reason."""
    tok_path = str(resolve_target(target.source, tokenizer_only=True))
    tok_sha = token_cache.tokenizer_sha256(tok_path)
    key = tokenize_key(cfg, target, conversations)

    def compute(uri: str) -> StageResult:
        opts = Options.of(cfg, target.vocab_size, trust_remote_code=target.trust_remote_code)
        # Workers start first: their start-up (imports, tokenizer, span probe) overlaps the parent's checks.
        # Spawned, they share nothing with this process (threads, the corpus pages).
        pool = None
        if cfg.num_workers:
            init = (tok_path, cfg.renderer, opts, True, os.getpid())
            pool = mp.get_context("spawn").Pool(cfg.num_workers, _init_worker, init)
        try:
            result = _compute(uri, opts, pool)
        except BaseException:
            if pool is not None:
                pool.terminate()  # nothing it still computes is wanted
            raise
        if pool is not None:
            pool.close()
            pool.join()
        return result

    def _compute(uri: str, opts: Options, pool: Any) -> StageResult:
        # A worker's renderer answers the template hash, so this process never imports transformers.
        if pool is None:
            _init_worker(tok_path, cfg.renderer, opts)
        template = pool.apply(token_encode.worker_template_sha256) if pool else token_encode.worker_template_sha256()
        provenance = check_provenance(cfg, conversations.info, template)
        sources = _sources(cfg, conversations)
        plan = _Plan(
            token_cache.TokenCache(_cache_uri(cfg, out_uri)),
            {
                "tokenizer": tok_sha,
                "template": template,
                "options": vars(opts) | {"renderer": cfg.renderer},
                "code": code_digest(_CODE),  # what the stage key hashes too
            },
            cfg.chunk_size,
        )
        with stage_progress(STAGE, uri, len(sources), "tokenize: source shards tokenized", unit="shard") as progress:
            progress.update(0)
            files, counts, rejects = _run_jobs(plan, sources, pool, uri, progress)
            files.append(rejects.write(uri))
            rejects.check(counts["rows"], cfg.max_rejected_share, where=storage.join(uri, REJECTED_FILE))
        info = {
            "renderer": cfg.renderer,
            "chat_template_sha256": template,
            "tokenizer_sha256": tok_sha,
            "thinking": cfg.thinking,
            "provenance": provenance,
        }
        return StageResult(files=files, counts=counts | rejects.counts(), info=info)

    return run_stage(STAGE, out_uri, key, compute)


@stage_task("tokenize", STAGE, key=tokenize_key)
def tokenize_task(
    cfg: TokenizeConfig, target: TargetConfig, conversations: StageManifest, run_dir: str
) -> StageManifest:
    return tokenize(cfg, target, conversations, out_uri=storage.join(run_dir, STAGE))
