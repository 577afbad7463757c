"""Configuration of the prompt-selection stage: sources, filters, category mix and the held-out split."""

import math
import os
from typing import Any, Literal

from pydantic import Field, model_validator

from draftsmith.core.config.base import StrictModel
from draftsmith.core.config.stages import Resources

# The synthetic pool's categories: defined here, with the recipe models that check `select.mix` against them,
# and imported by the pool (tasks/prompt_pool.py); tests/unit/test_prompt_filters.py checks the pool draws them.
SYNTHETIC_CATEGORIES: tuple[str, ...] = (
    "math",
    "coding",
    "reasoning",
    "writing",
    "multilingual",
    "dialogue",
    # Prompts whose answers reuse what the prompt holds (tasks/prompt_pool_reuse.py).
    "completion",
    "extraction",
    "editing",
    "followup",
)


class PromptWriting(StrictModel):
    """How the target writes its own prompts (a `target` source): sampled from its chat template's text up to
    a user message, the way an aligned chat model continues a conversation nobody has started (Magpie)."""

    temperature: float = Field(1.0, gt=0.0, description="Sampling temperature; the pool's variety comes from it.")
    top_p: float = Field(0.95, gt=0.0, le=1.0, description="Nucleus sampling mass; trims the incoherent tail.")
    max_new_tokens: int = Field(
        64, gt=0, description="Longest prompt written; a prompt not finished by then is rejected as `unfinished`."
    )
    batch_size: int = Field(128, gt=0, description="Prompts written per `generate` call.")
    system: str | None = Field(
        None, description="System message before the user turn; none: whatever the chat template adds by itself."
    )


class PromptSource(StrictModel):
    """One place prompts come from. File rows may be ShareGPT, OpenAI `messages`, `prompt` or `turns`."""

    kind: Literal["synthetic", "target", "jsonl", "parquet", "hf", "hf_disk"] = Field(
        description="`synthetic` (built-in pool), `target` (prompts the target writes itself, see `writing`), "
        "`jsonl`/`parquet` (local or fsspec URL, e.g. s3://), `hf` (datasets.load_dataset by name) or `hf_disk` "
        "(a Dataset.save_to_disk folder)."
    )
    path: str | None = Field(
        None, description="File or URL (jsonl/parquet), dataset name (hf) or folder (hf_disk); none for synthetic."
    )
    subset: str | None = Field(None, description="Hugging Face dataset configuration name (hf only).")
    split: str = Field("train", min_length=1, description="Dataset split (hf, and hf_disk holding a DatasetDict).")
    revision: str | None = Field(None, description="Dataset revision to pin (hf only); part of the stage key.")
    category: str = Field(
        "file", min_length=1, description="Category of rows that carry none (`self` for a `target` source)."
    )
    max_rows: int | None = Field(
        None,
        gt=0,
        description="Read at most this many rows (synthetic and target: pool size, default 2 x num_prompts).",
    )
    writing: PromptWriting | None = Field(
        None, description="Sampling of a `target` source (only there); none: the `PromptWriting` defaults."
    )
    id_prefix: str | None = Field(
        None, min_length=1, description="Prefix of generated ids `<prefix>-<row>`; defaults to the path's basename."
    )

    @model_validator(mode="before")
    @classmethod
    def _target_category(cls, data: Any) -> Any:
        # Rows the target writes carry no category; `file` would misname them in the mix and the report.
        if isinstance(data, dict) and data.get("kind") == "target" and "category" not in data:
            return {**data, "category": "self"}
        return data

    def label(self) -> str:
        """The id prefix of rows without an id: `id_prefix`, else the basename of `path`."""
        if self.id_prefix:
            return self.id_prefix
        return os.path.basename((self.path or self.kind).rstrip("/")) or self.kind


class SelectConfig(StrictModel):
    """Prompt selection: read sources, normalise, filter, mix categories and hold out an eval split."""

    source: Literal["synthetic", "jsonl"] = Field(
        "synthetic", description="Single-source shorthand; use `sources` for several or other formats."
    )
    path: str | None = Field(None, description="JSONL file (local or fsspec URL) when source is `jsonl`.")
    sources: list[PromptSource] | None = Field(
        None, min_length=1, description="Prompt sources, read in order (replaces `source`/`path`)."
    )
    num_prompts: int = Field(gt=0, description="Prompts kept in all (train + eval); fewer if sources run short.")
    num_eval: int = Field(gt=0, description="Prompts held out for evaluation, exactly, stratified by category.")
    mix: dict[str, float] | None = Field(
        None, description="Target category proportions of the kept prompts; default: as available."
    )
    min_prompt_tokens: int = Field(1, ge=1, description="Drop prompts (system + turns + tools) shorter than this.")
    max_prompt_tokens: int | None = Field(None, gt=0, description="Drop prompts longer than this many tokens.")
    near_dedupe: bool = Field(True, description="Remove near duplicates (MinHash LSH over user turns).")
    near_dup_threshold: float = Field(0.7, gt=0.0, le=1.0, description="Estimated Jaccard at which two are duplicates.")
    minhash_num_perm: int = Field(128, ge=16, le=1024, description="MinHash permutations (accuracy vs speed).")
    shingle_size: int = Field(3, ge=1, description="Words per shingle for near-duplicate detection.")
    decontam_ngram: int = Field(13, ge=1, description="Words per n-gram that marks train text as contaminated.")
    benchmark_files: list[str] = Field(
        default_factory=list, description="Benchmark prompt files (JSONL/Parquet) that train must not overlap."
    )
    max_rejected_share: float = Field(
        0.01, ge=0.0, le=1.0, description="Fail when more than this share of source rows is unusable."
    )
    resources: Resources = Field(default_factory=Resources, description="Where this stage runs.")

    @model_validator(mode="after")
    def _check(self) -> "SelectConfig":
        if self.source == "jsonl" and not self.path:
            raise ValueError("select.path: required when select.source is 'jsonl'")
        # Judged by value, not by which keys were written, so a dumped recipe validates again.
        if self.sources is not None and (self.path is not None or self.source != "synthetic"):
            raise ValueError("select.sources: give either `sources` or `source`/`path`, not both")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < self.min_prompt_tokens:
            raise ValueError(
                f"select.max_prompt_tokens: {self.max_prompt_tokens} is below select.min_prompt_tokens "
                f"({self.min_prompt_tokens})"
            )
        self._check_sources()
        self._check_mix()
        return self

    def _check_sources(self) -> None:
        labels: dict[str, int] = {}
        for i, src in enumerate(self.resolved_sources()):
            where = f"select.sources[{i}]"
            if src.kind in ("synthetic", "target") and src.path is not None:
                raise ValueError(f"{where}.path: a {src.kind} source takes no path")
            if src.kind not in ("synthetic", "target") and not src.path:
                raise ValueError(f"{where}.path: required for kind {src.kind!r}")
            if src.subset and src.kind != "hf":
                raise ValueError(f"{where}.subset: only kind 'hf' takes a subset")
            if src.writing is not None and src.kind != "target":
                raise ValueError(f"{where}.writing: only kind 'target' takes writing settings")
            if src.label() in labels:
                raise ValueError(
                    f"{where}.id_prefix: {src.label()!r} is also the id prefix of select.sources[{labels[src.label()]}]"
                    "; set distinct id_prefix values"
                )
            labels[src.label()] = i

    def _check_mix(self) -> None:
        if self.mix is None:
            return
        for name, weight in self.mix.items():
            if isinstance(weight, bool) or not math.isfinite(weight) or weight < 0:
                raise ValueError(f"select.mix.{name}: weight must be a finite number >= 0, got {weight!r}")
        if not any(w > 0 for w in self.mix.values()):
            raise ValueError("select.mix: weights must not all be zero")
        if all(s.kind == "synthetic" for s in self.resolved_sources()):
            unknown = sorted(set(self.mix) - set(SYNTHETIC_CATEGORIES))
            if unknown:
                raise ValueError(
                    f"select.mix: unknown category {unknown[0]!r} for the synthetic pool; "
                    f"known: {', '.join(SYNTHETIC_CATEGORIES)}"
                )

    def resolved_sources(self) -> list[PromptSource]:
        """`sources`, or the one source the `source`/`path` shorthand names."""
        if self.sources is not None:
            return list(self.sources)
        if self.source == "jsonl":
            return [PromptSource(kind="jsonl", path=self.path)]
        return [PromptSource(kind="synthetic")]
