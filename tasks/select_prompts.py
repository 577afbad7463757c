"""Stage 1: choose the prompts the target will answer, and hold some out for evaluation."""

import sys
from collections import Counter

from draftsmith import storage
from draftsmith.caching import stage_task
from draftsmith.config import SelectConfig
from draftsmith.manifest import StageManifest, file_entry
from draftsmith.stage import StageResult, run_stage, stage_key
from tasks import prompt_pool, prompt_sources
from tasks.prompt_pool import PromptRecord

STAGE = "select_prompts"


def _load(cfg: SelectConfig, seed: int) -> list[PromptRecord]:
    if cfg.source == "synthetic":
        return prompt_pool.synthetic_pool(cfg.num_prompts, seed=seed, mix=cfg.mix)
    assert cfg.path is not None  # enforced by PipelineConfig
    return prompt_sources.read_prompts_jsonl(cfg.path)


def read_prompts(manifest: StageManifest, split: str) -> list[PromptRecord]:
    """Records of one split (`train` or `eval`) written by this stage."""
    return [PromptRecord.model_validate(r) for r in storage.read_jsonl(manifest.path(f"{split}.jsonl"))]


def select_prompts(cfg: SelectConfig, *, seed: int, out_uri: str) -> StageManifest:
    """Draw, deduplicate and split prompts into `train.jsonl` and `eval.jsonl` under `out_uri`."""
    key = stage_key(STAGE, [sys.modules[__name__], prompt_pool, prompt_sources], cfg=cfg, seed=seed)

    def compute(uri: str) -> StageResult:
        records, duplicates = prompt_sources.dedupe(_load(cfg, seed))
        records = records[: cfg.num_prompts]
        if len(records) <= cfg.num_eval:
            raise ValueError(
                f"select: only {len(records)} distinct prompts, not enough for select.num_eval={cfg.num_eval}"
            )
        train, held_out = prompt_sources.split_heldout(records, eval_fraction=cfg.num_eval / len(records), seed=seed)
        files = [
            file_entry(uri, f"{name}.jsonl", _jsonl_bytes(rows))
            for name, rows in (("train", train), ("eval", held_out))
        ]
        counts = {"train": len(train), "eval": len(held_out), "dropped_duplicate": duplicates}
        counts |= {f"category.{c}": n for c, n in sorted(Counter(r.category for r in records).items())}
        return StageResult(files=files, counts=counts)

    return run_stage(STAGE, out_uri, key, compute)


def _jsonl_bytes(rows: list[PromptRecord]) -> bytes:
    return "".join(r.model_dump_json() + "\n" for r in rows).encode()


@stage_task("select-prompts", STAGE)
def select_prompts_task(cfg: SelectConfig, seed: int, run_dir: str) -> StageManifest:
    return select_prompts(cfg, seed=seed, out_uri=storage.join(run_dir, STAGE))
