"""Stage 2: the target answers every training prompt, turn by turn, written as conversation shards.

Drafters learn the target's own distribution, so the responses come from the target rather than from
the dataset. The stage is engine-agnostic (`draftsmith.engines.factory.make_engine`: hf, openai, vllm).

- Multi-turn: turn k of a prompt is generated after, and conditioned on, the regenerated turns before it.
- Samples: with `n > 1` the first turn is sampled n times in one request and each sample forks its own
  conversation `<id>#<s>`, which continues with one sample per later turn. With `n == 1` ids are kept.
- Resume by completed ids: pending prompts are taken in order, `shard_size` at a time; a chunk's
  kept rows go to `conversations-NNNNN.jsonl`, then `chunks/NNNNN.json` (its prompt ids and dropped
  rows) commits it. A rerun skips every committed prompt id and redoes an uncommitted chunk whole, so a
  killed run loses at most one chunk and never duplicates a row; the chunks of a resumed run are the
  chunks of an uninterrupted one.
- Validation: a conversation with an empty answer (no text, no tool call), or with a truncated turn when
  `drop_truncated`, stops being continued and goes to `rejected.jsonl`; the manifest counts
  `dropped.<reason>` and the stage fails when the dropped share passes `max_rejected_share`.
"""

import json
import logging
import re
import sys
from dataclasses import dataclass, field

from transformers import AutoTokenizer

from draftsmith.core import storage
from draftsmith.core.caching import stage_task
from draftsmith.core.config import RegenerateConfig, TargetConfig
from draftsmith.core.manifest import FileEntry, StageManifest, entry, file_entry
from draftsmith.core.progress import Progress, stage_progress
from draftsmith.core.rejects import REJECTED_FILE, Rejects
from draftsmith.core.stage import StageResult, run_stage, stage_key
from draftsmith.core.target_setup import resolve_target
from draftsmith.engines import factory
from draftsmith.engines.base import ChatRequest, Completion, Message, SamplingParams, TargetEngine, template_hash
from draftsmith.tasks.prompt_pool import PromptRecord
from draftsmith.tasks.select_prompts import read_prompts

log = logging.getLogger(__name__)
STAGE = "regenerate"
DROP_REASONS = ("empty_answer", "truncated")
_SHARD = re.compile(r"conversations-(\d{5})\.jsonl")


@dataclass
class _Fork:
    """One conversation being regenerated."""

    record: PromptRecord
    id: str
    messages: list[Message]
    finish: list[str] = field(default_factory=list)
    drop: tuple[str, str] | None = None  # (reason, detail) once rejected

    def row(self) -> dict:
        row = {"id": self.id, "category": self.record.category, "messages": self.messages, "finish": self.finish}
        if self.record.tools:
            row["tools"] = self.record.tools
        return row


def _user(record: PromptRecord, turn: int) -> list[Message]:
    """The messages opening user turn `turn`: the system prompt first, before turn 0."""
    system = [{"role": "system", "content": record.system}] if record.system and turn == 0 else []
    return [*system, {"role": "user", "content": record.turns[turn]}]


def _assistant(c: Completion) -> Message:
    msg: Message = {"role": "assistant", "content": c.text}
    if c.reasoning:
        msg["reasoning_content"] = c.reasoning
    if c.tool_calls:
        msg["tool_calls"] = c.tool_calls
    return msg


def _answer(fork: _Fork, c: Completion, turn: int, cfg: RegenerateConfig) -> None:
    """Append a generated turn to `fork`, marking the fork dropped when the turn is unusable."""
    fork.messages.append(_assistant(c))
    fork.finish.append(c.finish_reason)
    if not c.text.strip() and not c.tool_calls:
        fork.drop = ("empty_answer", f"assistant turn {turn} is empty")
    elif c.finish_reason == "length" and cfg.drop_truncated:
        fork.drop = ("truncated", f"assistant turn {turn} hit max_new_tokens={cfg.max_new_tokens}")


def sampling_params(cfg: RegenerateConfig, *, n: int, seed: int) -> SamplingParams:
    """Sampling for one engine call; hf and vllm render the template, so thinking is a template kwarg."""
    extra = dict(cfg.extra_body)
    if cfg.engine != "openai":
        extra["enable_thinking"] = cfg.thinking
    return SamplingParams(
        max_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p, n=n, seed=seed, extra_body=extra
    )


def _call(engine: TargetEngine, forks: list[_Fork], params: SamplingParams) -> list[list[Completion]]:
    outs = engine.chat([ChatRequest(messages=f.messages, tools=f.record.tools) for f in forks], params)
    if len(outs) != len(forks) or any(len(o) != params.n for o in outs):
        raise RuntimeError(f"regenerate: the engine answered {len(outs)} requests of {len(forks)}, or a wrong n")
    return outs


def regenerate_records(
    engine: TargetEngine, cfg: RegenerateConfig, records: list[PromptRecord], *, seed: int
) -> list[_Fork]:
    """Generate every assistant turn of `records`: `cfg.n` forks per record, in record then sample order."""
    firsts = [_Fork(record=r, id=r.id, messages=_user(r, 0)) for r in records]
    outs = _call(engine, firsts, sampling_params(cfg, n=cfg.n, seed=seed))
    forks = []
    for first, completions in zip(firsts, outs, strict=True):
        for s, c in enumerate(completions):
            fork_id = f"{first.id}#{s}" if cfg.n > 1 else first.id
            fork = _Fork(record=first.record, id=fork_id, messages=list(first.messages))
            _answer(fork, c, 0, cfg)
            forks.append(fork)
    for turn in range(1, max(len(r.turns) for r in records)):
        live = [f for f in forks if f.drop is None and len(f.record.turns) > turn]
        if not live:
            break
        for f in live:
            f.messages.extend(_user(f.record, turn))
        for f, [c] in zip(live, _call(engine, live, sampling_params(cfg, n=1, seed=seed + turn)), strict=True):
            _answer(f, c, turn, cfg)
    return forks


@dataclass
class _Chunk:
    """A committed chunk: its shard, the prompt ids it answered and the rows it dropped."""

    index: int
    shard: str
    prompt_ids: list[str]
    rejected: list[dict]


def _chunk_url(uri: str, index: int) -> str:
    return storage.join(uri, "chunks", f"{index:05d}.json")


def _committed(uri: str) -> tuple[list[_Chunk], list[_Chunk]]:
    """Chunks whose commit record exists, in index order (a shard without one is redone): those whose shard
    still matches the record, and those whose shard does not (to redo under their own index)."""
    intact: list[_Chunk] = []
    damaged: list[_Chunk] = []
    for name in storage.list_names(uri):
        match = _SHARD.fullmatch(name)
        if match and storage.exists(_chunk_url(uri, int(match[1]))):
            rec = storage.read_json(_chunk_url(uri, int(match[1])))
            chunk = _Chunk(int(match[1]), name, rec["prompt_ids"], rec["rejected"])
            problem = _shard_problem(uri, name, rec)
            if problem is not None:
                log.warning("regenerate: %s; answering chunk %d again", problem, chunk.index)
            (intact if problem is None else damaged).append(chunk)
    return sorted(intact, key=lambda c: c.index), sorted(damaged, key=lambda c: c.index)


def _shard_problem(uri: str, shard: str, record: dict) -> str | None:
    """Why the shard differs from its commit record; records from before digests were kept are trusted."""
    if "digest" not in record:
        return None
    entry = FileEntry(name=shard, bytes=record["bytes"], digest=record["digest"], algo=record["algo"])
    return entry.problem(storage.join(uri, shard))


def _run_chunk(
    engine: TargetEngine, cfg: RegenerateConfig, uri: str, index: int, records: list[PromptRecord], seed: int
) -> _Chunk:
    """Regenerate one chunk and commit it: the shard first, then its commit record."""
    shard = f"conversations-{index:05d}.jsonl"
    rejects = Rejects(STAGE)
    kept = []
    for fork in regenerate_records(engine, cfg, records, seed=seed + 1000 * index):
        if fork.drop is None:
            kept.append(fork.row())
        else:
            reason, detail = fork.drop
            rejects.add(source=shard, reason=reason, detail=detail, row_id=fork.id, raw=json.dumps(fork.row()))
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept).encode()
    written = file_entry(uri, shard, data)
    chunk = _Chunk(index, shard, [r.id for r in records], rejects.rows)
    record = {"prompt_ids": chunk.prompt_ids, "rejected": chunk.rejected, "bytes": written.bytes}
    storage.write_json(_chunk_url(uri, index), record | {"digest": written.digest, "algo": written.algo})
    return chunk


def _template_provenance(cfg: RegenerateConfig, target: TargetConfig, described: dict[str, str]) -> tuple[str, str]:
    """`(chat_template_sha256, chat_template_source)`: declared by the recipe, reported by the engine,
    or read from the local target tokenizer (a remote server is assumed to serve that template)."""
    reported = described.get("chat_template_sha256")
    if cfg.chat_template_sha256:
        if reported and reported != cfg.chat_template_sha256:
            raise ValueError(
                f"regenerate.chat_template_sha256: the recipe declares {cfg.chat_template_sha256} but the "
                f"{described.get('engine')} engine renders with {reported}"
            )
        return cfg.chat_template_sha256, "recipe"
    if reported:
        return reported, "engine"
    try:
        folder = resolve_target(target.source, tokenizer_only=True)
    except (ValueError, FileNotFoundError) as err:
        raise ValueError(
            f"regenerate.chat_template_sha256: the {described.get('engine')} engine cannot report its chat "
            f"template and target.source is not a local model folder ({err}); declare the hash in the recipe"
        ) from err
    tok = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=target.trust_remote_code)
    log.warning("regenerate: recording the local target tokenizer's chat template; the server must serve it")
    return template_hash(tok.chat_template), "target_tokenizer"


def provenance(cfg: RegenerateConfig, target: TargetConfig, engine: TargetEngine, seed: int) -> dict[str, str]:
    """The manifest `info`: engine, model, sampling, chat template hash and source, thinking, extra_body keys."""
    described = engine.describe()
    sha, source = _template_provenance(cfg, target, described)
    sampling = {"temperature": cfg.temperature, "top_p": cfg.top_p, "max_tokens": cfg.max_new_tokens}
    info = {k: v for k, v in described.items() if k != "chat_template_sha256"}
    return info | {
        "sampling": json.dumps(sampling | {"n": cfg.n, "seed": seed}, sort_keys=True),
        "chat_template_sha256": sha,
        "chat_template_source": source,
        "thinking": "on" if cfg.thinking else "off",
        # Keys only: values may carry tokens or other secrets.
        "extra_body": ",".join(sorted(sampling_params(cfg, n=cfg.n, seed=seed).extra_body)),
    }


def _generate(
    engine: TargetEngine, cfg: RegenerateConfig, uri: str, records: list[PromptRecord], seed: int, progress: Progress
) -> list[_Chunk]:
    """Commit chunks until every prompt id is answered; the chunks in index order. `progress` counts prompts."""
    chunks, damaged = _committed(uri)
    done = {pid for c in chunks for pid in c.prompt_ids}
    if chunks:
        log.info("regenerate: resuming; %d of %d prompts already committed", len(done), len(records))
    progress.update(len(done))
    by_id = {r.id: r for r in records}
    for bad in damaged:  # the same prompts under the same index (and so seed) as the first time
        redo = [by_id[pid] for pid in bad.prompt_ids if pid in by_id]
        chunks.append(_run_chunk(engine, cfg, uri, bad.index, redo, seed))
        done.update(r.id for r in redo)
        progress.advance(len(redo))
    chunks.sort(key=lambda c: c.index)
    pending = [r for r in records if r.id not in done]
    index = max((c.index for c in chunks), default=-1) + 1
    for start in range(0, len(pending), cfg.shard_size):
        chunks.append(_run_chunk(engine, cfg, uri, index, pending[start : start + cfg.shard_size], seed))
        progress.advance(len(chunks[-1].prompt_ids))
        log.info(
            "regenerate: chunk %d committed (%d/%d prompts)",
            index,
            len(done) + start + len(chunks[-1].prompt_ids),
            len(records),
        )
        index += 1
    return chunks


def _key_config(cfg: RegenerateConfig) -> str:
    """The config as the stage key sees it: which server, how many connections and how patient are
    operational, so moving to another endpoint serving the same model resumes rather than restarts."""
    data = cfg.model_dump(mode="json", exclude={"resources"})
    if cfg.openai is not None:
        data["openai"] = {"model": cfg.openai.model}
    return json.dumps(data, sort_keys=True)


def regenerate_key(cfg: RegenerateConfig, target: TargetConfig, prompts: StageManifest, seed: int) -> str:
    """The stage key (`draftsmith.core.stage.stage_key`): config (operational fields aside), target, prompts, seed."""
    code = [sys.modules[__name__], factory.engine_module(cfg)]
    return stage_key(STAGE, code, cfg=_key_config(cfg), target=target, prompts=prompts, seed=seed)


def regenerate(
    cfg: RegenerateConfig,
    target: TargetConfig,
    prompts: StageManifest,
    *,
    seed: int,
    out_uri: str,
    engine: TargetEngine | None = None,
) -> StageManifest:
    """Write `conversations-NNNNN.jsonl` shards of regenerated training conversations.

    Args:
        engine: An already started engine to use (and leave open); by default one is made from `cfg`
            and closed at the end.
    """
    key = regenerate_key(cfg, target, prompts, seed)

    def compute(uri: str) -> StageResult:
        records = read_prompts(prompts, "train")
        answered = "regenerate: training prompts answered"
        with stage_progress(STAGE, uri, len(records), answered, unit="prompt") as progress:
            eng = engine if engine is not None else factory.make_engine(cfg, target)
            try:
                info = provenance(cfg, target, eng, seed)  # before any work: an unknown template fails fast
                chunks = _generate(eng, cfg, uri, records, seed, progress)
            finally:
                if engine is None:
                    eng.close()
            # Recorded for `draftsmith doctor`: a drafter trained on prompts with (or without) a system message
            # sees other prefixes when served the other way, since templates add a default one of their own.
            system = sum(1 for r in records if r.system)
            return _finish(cfg, uri, chunks, len(records), info, system_prompts=system)

    return run_stage(STAGE, out_uri, key, compute)


def _finish(
    cfg: RegenerateConfig, uri: str, chunks: list[_Chunk], num_prompts: int, info: dict, *, system_prompts: int
) -> StageResult:
    files: list[FileEntry] = []
    kept = 0
    for chunk in chunks:
        data = storage.read_bytes(storage.join(uri, chunk.shard))
        files.append(entry(chunk.shard, data))
        kept += data.count(b"\n")
    rejects = Rejects(STAGE, rows=[row for c in chunks for row in c.rejected])
    files.append(rejects.write(uri))
    rejects.check(num_prompts * cfg.n, cfg.max_rejected_share, where=storage.join(uri, REJECTED_FILE))
    dropped = {f"dropped.{r}": sum(row["reason"] == r for row in rejects.rows) for r in DROP_REASONS}
    files.append(file_entry(uri, "provenance.json", json.dumps(info, indent=2).encode()))
    counts = {"prompts": num_prompts, "system_prompts": system_prompts, "conversations": kept}
    return StageResult(files=files, counts=counts | dropped, info=info)


def read_conversations(manifest: StageManifest) -> list[dict]:
    rows: list[dict] = []
    for name in manifest.names("conversations-"):
        rows.extend(storage.read_jsonl(manifest.path(name)))
    return rows


@stage_task("regenerate", STAGE, key=regenerate_key)
def regenerate_task(
    cfg: RegenerateConfig, target: TargetConfig, prompts: StageManifest, seed: int, run_dir: str
) -> StageManifest:
    return regenerate(cfg, target, prompts, seed=seed, out_uri=storage.join(run_dir, STAGE))
