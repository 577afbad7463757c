"""Stage 2: the target answers every training prompt, turn by turn, written as conversation shards.

Drafters learn the target's own distribution, so the responses come from the target rather than from
the dataset. Turn k of a multi-turn prompt is generated after, and conditioned on, the regenerated
turns before it. Each shard is written atomically and skipped on rerun, so a killed run resumes.
"""

import hashlib
import json
import logging
import sys
from collections import Counter

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from draftsmith import storage
from draftsmith.caching import stage_task
from draftsmith.config import RegenerateConfig, TargetConfig
from draftsmith.manifest import FileEntry, StageManifest, file_entry
from draftsmith.stage import StageResult, run_stage, stage_key
from engines import hf
from tasks.prompt_pool import PromptRecord
from tasks.select_prompts import read_prompts

log = logging.getLogger(__name__)
STAGE = "regenerate"


def _messages(record: PromptRecord, answers: list[str], upto: int) -> list[hf.Message]:
    """System prompt, then user/assistant pairs up to and including user turn `upto`."""
    msgs: list[hf.Message] = [{"role": "system", "content": record.system}] if record.system else []
    for k in range(upto + 1):
        msgs.append({"role": "user", "content": record.turns[k]})
        if k < upto:
            msgs.append({"role": "assistant", "content": answers[k]})
    return msgs


def regenerate_shard(
    cfg: RegenerateConfig,
    model: PreTrainedModel,
    tok: PreTrainedTokenizerBase,
    records: list[PromptRecord],
    seed: int,
) -> list[dict]:
    """Generate every assistant turn of `records`; one row per conversation with `finish` per turn."""
    torch.manual_seed(seed)
    answers: list[list[str]] = [[] for _ in records]
    finish: list[list[str]] = [[] for _ in records]
    for turn in range(max(len(r.turns) for r in records)):
        pending = [i for i, r in enumerate(records) if len(r.turns) > turn]
        for start in range(0, len(pending), cfg.batch_size):
            batch = pending[start : start + cfg.batch_size]
            outs = hf.chat_generate(
                model,
                tok,
                [_messages(records[i], answers[i], turn) for i in batch],
                max_new_tokens=cfg.max_new_tokens,
                temperature=cfg.temperature,
                top_p=cfg.top_p,
            )
            for i, out in zip(batch, outs, strict=True):
                answers[i].append(out.text)
                finish[i].append("stop" if out.finished else "length")
    rows = []
    for record, ans, fin in zip(records, answers, finish, strict=True):
        msgs = _messages(record, ans, len(record.turns) - 1)
        msgs.append({"role": "assistant", "content": ans[-1]})
        rows.append({"id": record.id, "category": record.category, "messages": msgs, "finish": fin})
    return rows


def _template_hash(tok: PreTrainedTokenizerBase) -> str:
    return hashlib.sha256((tok.chat_template or "").encode()).hexdigest()[:16]


def regenerate(
    cfg: RegenerateConfig, target: TargetConfig, prompts: StageManifest, *, seed: int, out_uri: str
) -> StageManifest:
    """Write `conversations-NNNNN.jsonl` shards of regenerated training conversations."""
    if cfg.engine != "hf":
        raise NotImplementedError(
            f"regenerate.engine: {cfg.engine!r} is not available yet (issue #3); use 'hf' on this build"
        )
    key = stage_key(STAGE, [sys.modules[__name__], hf], cfg=cfg, target=target, prompts=prompts, seed=seed)

    def compute(uri: str) -> StageResult:
        records = read_prompts(prompts, "train")
        model, tok = hf.load_target(target)
        files: list[FileEntry] = []
        drops: Counter[str] = Counter()
        kept = 0
        for index, start in enumerate(range(0, len(records), cfg.shard_size)):
            name = f"conversations-{index:05d}.jsonl"
            url = storage.join(uri, name)
            if storage.exists(url):
                log.info("regenerate: %s already written, skipping", name)
                rows = storage.read_jsonl(url)
                # Only empty answers are dropped, so a finished shard's shortfall is exactly those.
                drops["empty_answer"] += len(records[start : start + cfg.shard_size]) - len(rows)
            else:
                rows = regenerate_shard(cfg, model, tok, records[start : start + cfg.shard_size], seed + index)
                rows, dropped = _validate(rows)
                drops.update(dropped)
                storage.write_jsonl(url, rows)
            data = storage.read_bytes(url)
            files.append(FileEntry(name=name, bytes=len(data), sha256=storage.sha256(data)))
            kept += len(rows)
            log.info("regenerate: shard %d done (%d/%d prompts)", index, start + len(rows), len(records))
        counts = {"conversations": kept} | {f"dropped.{k}": v for k, v in drops.items() if v}
        info = {
            "engine": cfg.engine,
            "model": target.name,
            "chat_template_sha256": _template_hash(tok),
            "sampling": f"temperature={cfg.temperature},top_p={cfg.top_p},max_new_tokens={cfg.max_new_tokens}",
        }
        files.append(file_entry(uri, "provenance.json", json.dumps(info, indent=2).encode()))
        return StageResult(files=files, counts=counts, info=info)

    return run_stage(STAGE, out_uri, key, compute)


def _validate(rows: list[dict]) -> tuple[list[dict], Counter[str]]:
    """Drop conversations with an empty assistant turn; count drops by reason."""
    kept, drops = [], Counter[str]()
    for row in rows:
        if any(m["role"] == "assistant" and not m["content"].strip() for m in row["messages"]):
            drops["empty_answer"] += 1
        else:
            kept.append(row)
    return kept, drops


def read_conversations(manifest: StageManifest) -> list[dict]:
    rows: list[dict] = []
    for name in manifest.names("conversations-"):
        rows.extend(storage.read_jsonl(manifest.path(name)))
    return rows


@stage_task("regenerate", STAGE)
def regenerate_task(
    cfg: RegenerateConfig, target: TargetConfig, prompts: StageManifest, seed: int, run_dir: str
) -> StageManifest:
    return regenerate(cfg, target, prompts, seed=seed, out_uri=storage.join(run_dir, STAGE))
