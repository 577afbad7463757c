"""Stage 3: render conversations with the target's chat template and mark assistant tokens for loss.

The loss mask comes from render boundaries, which works for any template: the prefix rendered with
`add_generation_prompt=True` ends where assistant turn i begins, the conversation rendered through
turn i ends where it stops, and the tokens whose first character lies between are loss tokens.
Workers return numpy arrays as bytes; the pool starts before the corpus is read.
"""

import json
import multiprocessing as mp
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.pool import Pool

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from draftsmith import storage, tensorio
from draftsmith.caching import stage_task
from draftsmith.config import TargetConfig, TokenizeConfig
from draftsmith.manifest import FileEntry, StageManifest, file_entry
from draftsmith.stage import StageResult, run_stage, stage_key
from draftsmith.target_setup import resolve_target

STAGE = "tokenize"


@dataclass(frozen=True)
class Encoded:
    """One tokenized conversation: `input_ids` int32 `[S]`, `loss_mask` uint8 `[S]`."""

    input_ids: np.ndarray
    loss_mask: np.ndarray
    truncated: bool


def assistant_spans(
    tok: PreTrainedTokenizerBase, messages: Sequence[dict], *, last_turn_only: bool
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns."""
    full = tok.apply_chat_template(list(messages), tokenize=False)
    spans = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        prefix = tok.apply_chat_template(list(messages[:i]), add_generation_prompt=True, tokenize=False)
        through = tok.apply_chat_template(list(messages[: i + 1]), tokenize=False)
        if not (through.startswith(prefix) and full.startswith(through)):
            raise ValueError(
                f"chat template is not prefix-stable at message {i}: render boundaries cannot place the "
                "loss mask; use a renderer for this template"
            )
        spans.append((len(prefix), len(through)))
    if last_turn_only:
        spans = spans[-1:]
    return full, spans


def encode(tok: PreTrainedTokenizerBase, messages: Sequence[dict], *, max_length: int, last_turn_only: bool) -> Encoded:
    """Tokenize a conversation and build its assistant-only loss mask, truncated to `max_length`."""
    text, spans = assistant_spans(tok, messages, last_turn_only=last_turn_only)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], dtype=np.int32)
    starts = np.asarray([s for s, _ in enc["offset_mapping"]], dtype=np.int64)
    mask = np.zeros(len(ids), dtype=np.uint8)
    for lo, hi in spans:
        mask[(starts >= lo) & (starts < hi)] = 1
    truncated = len(ids) > max_length
    return Encoded(ids[:max_length], mask[:max_length], truncated)


_WORKER_TOK = None


def _init_worker(path: str) -> None:
    global _WORKER_TOK
    from transformers import AutoTokenizer

    _WORKER_TOK = AutoTokenizer.from_pretrained(path)


def _encode_job(job: tuple[list[dict], int, bool]) -> tuple[bytes, bytes, bool]:
    messages, max_length, last_only = job
    e = encode(_WORKER_TOK, messages, max_length=max_length, last_turn_only=last_only)
    return e.input_ids.tobytes(), e.loss_mask.tobytes(), e.truncated


def pack_shard(rows: list[tuple[dict, Encoded]]) -> bytes:
    """Concatenate samples into one safetensors blob: `input_ids` `[T]`, `loss_mask` `[T]`, `offsets` `[n+1]`."""
    lengths = [len(e.input_ids) for _, e in rows]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    ids = np.concatenate([e.input_ids for _, e in rows]) if rows else np.zeros(0, np.int32)
    mask = np.concatenate([e.loss_mask for _, e in rows]) if rows else np.zeros(0, np.uint8)
    tensors = {
        "input_ids": torch.from_numpy(ids),
        "loss_mask": torch.from_numpy(mask),
        "offsets": torch.from_numpy(offsets),
    }
    meta = {
        "ids": json.dumps([r["id"] for r, _ in rows]),
        "categories": json.dumps([r["category"] for r, _ in rows]),
    }
    return tensorio.dumps(tensors, meta)


def read_token_shard(data: bytes) -> list[dict]:
    """Inverse of `pack_shard`: a list of `{id, category, input_ids [S] int64, loss_mask [S] bool}`."""
    tensors, meta = tensorio.loads(data)
    ids, cats, off = json.loads(meta["ids"]), json.loads(meta["categories"]), tensors["offsets"].tolist()
    return [
        {
            "id": ids[i],
            "category": cats[i],
            "input_ids": tensors["input_ids"][off[i] : off[i + 1]].long(),
            "loss_mask": tensors["loss_mask"][off[i] : off[i + 1]].bool(),
        }
        for i in range(len(ids))
    ]


def tokenize(cfg: TokenizeConfig, target: TargetConfig, conversations: StageManifest, *, out_uri: str) -> StageManifest:
    """Write one `tokens-NNNNN.safetensors` per conversation shard."""
    key = stage_key(STAGE, [sys.modules[__name__]], cfg=cfg, target=target, conversations=conversations)
    tok_path = str(resolve_target(target.source))

    def compute(uri: str) -> StageResult:
        # The pool starts before the corpus is read, so workers never inherit (and dirty) its pages.
        ctx = mp.get_context("spawn")
        pool = ctx.Pool(cfg.num_workers, _init_worker, (tok_path,)) if cfg.num_workers else None
        if pool is None:
            _init_worker(tok_path)
        try:
            return _tokenize_shards(cfg, conversations, uri, pool)
        finally:
            if pool is not None:
                pool.close()
                pool.join()

    return run_stage(STAGE, out_uri, key, compute)


def _tokenize_shards(cfg: TokenizeConfig, conversations: StageManifest, uri: str, pool: Pool | None) -> StageResult:
    files: list[FileEntry] = []
    counts = {"samples": 0, "tokens": 0, "loss_tokens": 0, "truncated": 0, "dropped.min_loss_tokens": 0}
    for index, name in enumerate(conversations.names("conversations-")):
        rows = storage.read_jsonl(conversations.path(name))
        jobs = [(r["messages"], cfg.max_length, cfg.last_turn_only) for r in rows]
        results = pool.imap(_encode_job, jobs, chunksize=16) if pool else map(_encode_job, jobs)
        kept = []
        for row, (ids, mask, truncated) in zip(rows, results, strict=True):
            enc = Encoded(np.frombuffer(ids, np.int32), np.frombuffer(mask, np.uint8), truncated)
            if int(enc.loss_mask.sum()) < cfg.min_loss_tokens:
                counts["dropped.min_loss_tokens"] += 1
                continue
            kept.append((row, enc))
            counts["truncated"] += int(truncated)
            counts["tokens"] += len(enc.input_ids)
            counts["loss_tokens"] += int(enc.loss_mask.sum())
        counts["samples"] += len(kept)
        files.append(file_entry(uri, f"tokens-{index:05d}.safetensors", pack_shard(kept)))
    return StageResult(files=files, counts=counts)


@stage_task("tokenize", STAGE)
def tokenize_task(
    cfg: TokenizeConfig, target: TargetConfig, conversations: StageManifest, run_dir: str
) -> StageManifest:
    return tokenize(cfg, target, conversations, out_uri=storage.join(run_dir, STAGE))
