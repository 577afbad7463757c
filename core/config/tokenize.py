"""Configuration of the tokenization stage."""

from typing import Literal

from pydantic import Field, field_validator

from draftsmith.core.config.base import StrictModel
from draftsmith.core.config.stages import Resources


class TokenizeConfig(StrictModel):
    """Chat-template rendering with an assistant-only loss mask."""

    max_length: int = Field(1024, gt=8, description="Longest sample in tokens; see `truncation` for longer ones.")
    truncation: Literal["truncate", "drop", "keep_last_turns"] = Field(
        "truncate",
        description=(
            "Longer samples: `truncate` keeps the first `max_length` tokens; `drop` drops the sample; "
            "`keep_last_turns` drops whole leading user turns (system prompt kept) until it fits, and drops the "
            "sample when the last turn alone does not fit (pretokenized rows, which have no turns, are dropped)."
        ),
    )
    num_workers: int = Field(2, ge=0, description="Tokenizer processes; 0 tokenizes in-process.")
    chunk_size: int = Field(64, gt=0, description="Rows per worker job; each job renders and tokenizes in batch.")
    renderer: str = Field(
        "chat_template",
        min_length=1,
        description="`chat_template` (the target tokenizer's template) or a registered Python renderer, e.g. `kimi`.",
    )
    thinking: Literal["on", "off"] = Field(
        "off",
        description="`on` renders and trains assistant `reasoning_content`; `off` drops it. Must match regenerate.",
    )
    last_turn_only: bool = Field(False, description="Only the final assistant turn carries loss.")
    min_loss_tokens: int = Field(1, ge=0, description="Samples with fewer loss tokens are dropped.")
    extra_sources: list[str] = Field(
        default_factory=list,
        description="JSONL files (local or fsspec URL) of conversation or pretokenized rows, tokenized too.",
    )
    allow_provenance_mismatch: bool = Field(
        False, description="Tokenize a corpus whose chat-template hash or thinking mode differs from this stage's."
    )
    max_rejected_share: float = Field(
        0.01, ge=0.0, le=1.0, description="The stage fails when more than this share of input rows is rejected."
    )
    cache_uri: str | None = Field(
        None, description="Per-shard token cache folder; default `<run dir>/.cache/tokenize`. Empty string: off."
    )
    resources: Resources = Field(default_factory=Resources, description="Where this stage runs.")

    @field_validator("extra_sources")
    @classmethod
    def _sources_are_jsonl(cls, value: list[str]) -> list[str]:
        for i, src in enumerate(value):
            if not src.endswith(".jsonl"):
                raise ValueError(f"tokenize.extra_sources[{i}]: {src!r} must be a .jsonl file")
        if len(set(value)) != len(value):
            raise ValueError("tokenize.extra_sources: lists a file twice")
        return value

    @field_validator("thinking", mode="before")
    @classmethod
    def _yaml_booleans(cls, value: object) -> object:
        # YAML 1.1 reads a bare `on`/`off` as a boolean; accept it, and `regenerate.thinking`'s true/false.
        if isinstance(value, bool):
            return "on" if value else "off"
        return value
