"""Stage 1: choose the prompts the target will answer, and hold some out for evaluation.

Sources are read leniently (bad rows go to `rejected.jsonl`), then exact duplicates, prompts outside the
token-length limits, near duplicates and prompts overlapping benchmark files are dropped, in that order.
Without `select.max_prompt_tokens`, a prompt that leaves no room for its answers in the target's context
goes to `rejected.jsonl` too (reason `exceeds_context`), though it does not count against
`select.max_rejected_share`: the row is sound, only too long for this target;
the category mix picks `num_prompts`, exactly `num_eval` of them are held out, and train is
decontaminated against the held-out prompts. Every row read is accounted for: kept + dropped == read.
"""

import contextlib
import hashlib
import json
import logging
import sys
from collections import Counter
from pathlib import Path

from draftsmith.core import storage
from draftsmith.core.caching import stage_task
from draftsmith.core.config import RegenerateConfig, SelectConfig, TargetConfig
from draftsmith.core.config.select import PromptSource
from draftsmith.core.manifest import StageManifest, file_entry
from draftsmith.core.progress import Progress, stage_progress
from draftsmith.core.rejects import REJECTED_FILE, Rejects
from draftsmith.core.stage import StageResult, run_stage, stage_key
from draftsmith.tasks import prompt_filters, prompt_formats, prompt_sources, prompt_writer
from draftsmith.tasks.prompt_pool import PromptRecord

log = logging.getLogger(__name__)
STAGE = "select_prompts"
REPORT_FILE = "report.md"
ARTIFACT_KEY = "select-report"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt")
# Room left for each answer when the caller does not say: regenerate's default answer length.
DEFAULT_ANSWER_TOKENS: int = RegenerateConfig.model_fields["max_new_tokens"].default


def read_prompts(manifest: StageManifest, split: str) -> list[PromptRecord]:
    """Records of one split (`train` or `eval`) written by this stage."""
    return [PromptRecord.model_validate(r) for r in storage.read_jsonl(manifest.path(f"{split}.jsonl"))]


def _tokenizer_folder(target: TargetConfig) -> Path:
    from draftsmith.core.target_setup import resolve_target

    return resolve_target(target.source, tokenizer_only=True)


def _tokenizer_fingerprint(folder: Path) -> str:
    h = hashlib.sha256()
    for name in _TOKENIZER_FILES:
        if (folder / name).is_file():
            h.update(name.encode() + b"\0" + (folder / name).read_bytes())
    return h.hexdigest()


def _token_counter(folder: Path, trust_remote_code: bool):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust_remote_code)

    def count(texts: list[str]) -> list[int]:
        lengths: list[int] = []
        # Batches bound the tokenizer's memory on 150K prompts; the fast tokenizer parallelises each.
        with Progress(len(texts), desc=f"{STAGE}: token counts", unit="prompt") as progress:
            progress.update(0)
            for start in range(0, len(texts), 4096):
                ids = tok(texts[start : start + 4096], add_special_tokens=False)["input_ids"]
                lengths.extend(len(x) for x in ids)
                progress.advance(len(ids))
        return lengths

    return count


def _context_tokens(folder: Path) -> int | None:
    """The target's context window from its config.json, or None when it states none."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return prompt_filters.context_length(config) if isinstance(config, dict) else None


def _benchmark_texts(paths: list[str]) -> tuple[list[str], int]:
    """User texts of the recipe's benchmark files, and how many of their rows held none."""
    texts: list[str] = []
    unusable = 0
    for path in paths:
        rows = prompt_sources.parquet_rows(path) if path.endswith(".parquet") else prompt_sources.jsonl_rows(path)
        for _, row in rows:
            try:
                texts.extend(prompt_formats.reference_texts(row))
            except prompt_formats.RowError:
                unusable += 1
    return texts, unusable


def select_prompts_key(
    cfg: SelectConfig, target: TargetConfig, seed: int, answer_tokens: int = DEFAULT_ANSWER_TOKENS
) -> str:
    """The stage key (`draftsmith.core.stage.stage_key`): config, seed, the sources' and tokenizer's content,
    and the context bound when `cfg.max_prompt_tokens` is unset."""
    folder = _tokenizer_folder(target)
    context = (_context_tokens(folder), answer_tokens) if cfg.max_prompt_tokens is None else None
    # The target's identity matters only where it writes prompts; the tokenizer's is always in.
    writes = any(s.kind == "target" for s in cfg.resolved_sources())
    return stage_key(
        STAGE,
        [sys.modules[__name__]],
        cfg=cfg,
        seed=seed,
        sources=_fingerprints(cfg),
        tokenizer=_tokenizer_fingerprint(folder),
        context=context,
        **({"target": target} if writes else {}),
    )


def select_prompts(
    cfg: SelectConfig,
    target: TargetConfig,
    *,
    seed: int,
    out_uri: str,
    answer_tokens: int = DEFAULT_ANSWER_TOKENS,
) -> StageManifest:
    """Read, filter, mix and split prompts into `train.jsonl` and `eval.jsonl` under `out_uri`.

    Also writes `rejected.jsonl` (unusable source rows with file, line and reason) and `report.md`.
    `answer_tokens` (regenerate's `max_new_tokens`) is the room each turn's answer needs in the target's
    context; it bounds prompt length when `cfg.max_prompt_tokens` is unset.
    Manifest counts: `train`, `eval`, `read`, `category.<c>` (kept), `dropped.<reason>`,
    `rejected.<reason>` and `shortfall.<c>` (quota a category could not fill).

    Raises:
        RejectedShareError: More than `cfg.max_rejected_share` of the rows read were unusable.
        ValueError: Too few prompts survive for `cfg.num_eval` plus training.
    """
    sources = cfg.resolved_sources()
    folder = _tokenizer_folder(target)
    context = (_context_tokens(folder), answer_tokens) if cfg.max_prompt_tokens is None else None
    key = select_prompts_key(cfg, target, seed, answer_tokens)

    def compute(uri: str) -> StageResult:
        rejects = Rejects(STAGE)
        with _writer(sources, target, uri, 2 * cfg.num_prompts, seed) as write:
            loaded = prompt_sources.load_sources(
                sources, synthetic_rows=2 * cfg.num_prompts, mix=cfg.mix, seed=seed, rejects=rejects, write=write
            )
        rejects.write(uri)  # before the check: its message points at the file
        rejects.check(loaded.read, cfg.max_rejected_share, where=storage.join(uri, REJECTED_FILE))
        counter = _token_counter(folder, target.trust_remote_code)
        chosen, dropped = _filter(cfg, loaded.records, counter, context, rejects)
        files = [rejects.write(uri)]
        selection = prompt_filters.choose(
            chosen, num_prompts=cfg.num_prompts, num_eval=cfg.num_eval, mix=cfg.mix, seed=seed, ngram=cfg.decontam_ngram
        )
        dropped["contaminated"] += selection.contaminated
        dropped["over_mix_quota"] = selection.over_quota
        counts = _counts(loaded, selection, dropped, rejects)
        files += [file_entry(uri, f"{name}.jsonl", _jsonl_bytes(rows)) for name, rows in _splits(selection)]
        files.append(file_entry(uri, REPORT_FILE, render_report(counts, selection, loaded.read_by_source).encode()))
        log.info("select_prompts: %d train, %d eval of %d rows read", counts["train"], counts["eval"], counts["read"])
        return StageResult(files=files, counts=counts, info={"tokenizer": str(folder)})

    return run_stage(STAGE, out_uri, key, compute)


@contextlib.contextmanager
def _writer(sources: list[PromptSource], target: TargetConfig, uri: str, default_rows: int, seed: int):
    """`load_sources`' `write` for the `target` sources, with a progress bar over the prompts they write."""
    total = sum(s.max_rows or default_rows for s in sources if s.kind == "target")
    if not total:
        yield None
        return
    with stage_progress(STAGE, uri, total, "select_prompts: prompts the target wrote", unit="prompt") as progress:

        def write(src: PromptSource, count: int):
            return prompt_writer.written_rows(src, target, count=count, seed=seed, progress=progress)

        yield write


def _fingerprints(cfg: SelectConfig) -> list[str]:
    """Content identity of every input file, with the recipe field named when one is missing."""
    named: list[tuple[str, PromptSource | str]] = [
        (f"select.sources[{i}].path", s) for i, s in enumerate(cfg.resolved_sources())
    ]
    named += [(f"select.benchmark_files[{i}]", p) for i, p in enumerate(cfg.benchmark_files)]
    out = []
    for field, item in named:
        try:
            out.append(
                prompt_sources.source_fingerprint(item)
                if isinstance(item, PromptSource)
                else prompt_sources.path_fingerprint(item)
            )
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"{field}: {exc}") from None
    return out


def _reject_over_context(
    records: list[PromptRecord], lengths: list[int], context: tuple[int | None, int], rejects: Rejects
) -> tuple[list[PromptRecord], list[int]]:
    """Without `select.max_prompt_tokens`, the target's context bounds prompt length (see the module doc)."""
    window, answer_tokens = context
    if window is None:
        log.warning("select_prompts: the target's config.json states no context length; prompt length is unbounded")
        return records, lengths
    records, lengths, over = prompt_filters.split_over_context(
        records, lengths, context=window, answer_tokens=answer_tokens
    )
    for record, n, bound in over:
        rejects.add(
            source=STAGE,
            reason="exceeds_context",
            detail=f"prompt of {n} tokens is over {bound}: the target's context ({window}) less {answer_tokens} "
            f"answer tokens per turn ({len(record.turns)}); select.max_prompt_tokens sets another bound",
            row_id=record.id,
            raw=prompt_filters.prompt_texts(record),
        )
    return records, lengths


def _filter(
    cfg: SelectConfig, records: list[PromptRecord], count_tokens, context: tuple | None, rejects: Rejects
) -> tuple[list[PromptRecord], Counter]:
    dropped: Counter[str] = Counter()
    records, dropped["duplicate_exact"] = prompt_filters.exact_dedupe(records)
    lengths = prompt_filters.token_lengths(records, count_tokens)
    if context is not None:
        records, lengths = _reject_over_context(records, lengths, context, rejects)
    records, dropped["too_short"], dropped["too_long"] = prompt_filters.length_filter(
        records, count_tokens, min_tokens=cfg.min_prompt_tokens, max_tokens=cfg.max_prompt_tokens, lengths=lengths
    )
    if cfg.near_dedupe:
        with Progress(len(records), desc=f"{STAGE}: near duplicates", unit="prompt") as progress:
            progress.update(0)
            records, dropped["duplicate_near"] = prompt_filters.near_dedupe(
                records,
                threshold=cfg.near_dup_threshold,
                num_perm=cfg.minhash_num_perm,
                shingle_size=cfg.shingle_size,
                done=progress.advance,
            )
    if cfg.benchmark_files:
        texts, unusable = _benchmark_texts(cfg.benchmark_files)
        if unusable:
            log.warning("select_prompts: %d benchmark rows held no prompt text and were skipped", unusable)
        index = prompt_filters.ngram_index(texts, cfg.decontam_ngram)
        clean = [r for r in records if not prompt_filters.contaminated(r, index, cfg.decontam_ngram)]
        dropped["contaminated"] = len(records) - len(clean)
        records = clean
    return records, dropped


def _splits(selection: prompt_filters.Selection) -> list[tuple[str, list[PromptRecord]]]:
    return [("train", selection.train), ("eval", selection.eval)]


def _counts(
    loaded: prompt_sources.LoadedPrompts,
    selection: prompt_filters.Selection,
    dropped: Counter,
    rejects: Rejects,
) -> dict[str, int]:
    kept = selection.train + selection.eval
    counts = {"read": loaded.read, "train": len(selection.train), "eval": len(selection.eval)}
    counts |= {f"dropped.{reason}": n for reason, n in sorted(dropped.items())}
    counts |= rejects.counts()
    counts |= {f"category.{c}": n for c, n in sorted(Counter(r.category for r in kept).items())}
    counts |= {f"shortfall.{c}": n for c, n in sorted(selection.shortfall.items())}
    lost = sum(n for k, n in counts.items() if k.startswith(("dropped.", "rejected.")))
    # Every row read is kept or dropped for a reason; a gap here is a bug in this stage, not bad input.
    assert len(kept) + lost == loaded.read, f"select_prompts: {len(kept)} kept + {lost} dropped != {loaded.read}"
    return counts


def render_report(counts: dict[str, int], selection: prompt_filters.Selection, read_by_source: dict[str, int]) -> str:
    """The stage's markdown report: rows per source, kept per category and split, drops per reason."""
    train = Counter(r.category for r in selection.train)
    held = Counter(r.category for r in selection.eval)
    lines = ["# Prompt selection", "", "| source | rows read |", "|---|---:|"]
    lines += [f"| `{src}` | {n} |" for src, n in read_by_source.items()]
    lines += ["", "| category | train | eval | short of quota |", "|---|---:|---:|---:|"]
    for c in sorted(set(train) | set(held) | set(selection.shortfall)):
        lines.append(f"| {c} | {train[c]} | {held[c]} | {selection.shortfall.get(c, 0)} |")
    lines += ["", "| dropped because | rows |", "|---|---:|"]
    drops = {k: n for k, n in counts.items() if k.startswith(("dropped.", "rejected.")) and n}
    lines += [f"| {k.removeprefix('dropped.')} | {n} |" for k, n in drops.items()]
    kept = counts["train"] + counts["eval"]
    lines += [
        "",
        f"**{counts['read']} rows read = {kept} kept ({counts['train']} train, {counts['eval']} eval) "
        f"+ {sum(drops.values())} dropped.**",
        "",
    ]
    return "\n".join(lines)


def _jsonl_bytes(rows: list[PromptRecord]) -> bytes:
    return "".join(r.model_dump_json() + "\n" for r in rows).encode()


def publish_report(manifest: StageManifest) -> None:
    """Show `report.md` as the `select-report` Prefect artifact when inside a flow or task run."""
    from prefect.artifacts import create_markdown_artifact
    from prefect.context import FlowRunContext, TaskRunContext

    if FlowRunContext.get() is None and TaskRunContext.get() is None:
        return
    markdown = storage.read_bytes(manifest.path(REPORT_FILE)).decode()
    create_markdown_artifact(markdown=markdown, key=ARTIFACT_KEY, description="Prompt selection: kept and dropped")


@stage_task("select-prompts", STAGE, key=select_prompts_key)
def select_prompts_task(
    cfg: SelectConfig, target: TargetConfig, seed: int, run_dir: str, answer_tokens: int = DEFAULT_ANSWER_TOKENS
) -> StageManifest:
    manifest = select_prompts(cfg, target, seed=seed, out_uri=storage.join(run_dir, STAGE), answer_tokens=answer_tokens)
    publish_report(manifest)
    return manifest
