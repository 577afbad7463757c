"""The serving throughput sweep's settings: concurrency levels, requests, prompts and sampling."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from draftsmith.core.config.base import StrictModel

DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_PROMPTS = (
    "Explain why the sky is blue in three sentences.",
    "Write a short Python function that checks whether a number is prime.",
    "Summarise the causes of the First World War.",
    "What are the health benefits of regular exercise?",
    "Give me a recipe for a simple tomato soup.",
    "Translate 'Good morning, how are you?' into French and Spanish.",
    "List five tips for writing clear technical documentation.",
    "If a train travels 120 km in 1.5 hours, what is its average speed? Show your work.",
)


def _distinct_levels(v: tuple[int, ...]) -> tuple[int, ...]:
    """Concurrency levels in increasing order; each positive and given once."""
    if any(c < 1 for c in v) or len(set(v)) != len(v):
        raise ValueError(f"concurrency: levels must be distinct positive integers, got {list(v)}")
    return tuple(sorted(v))


class SweepConfig(StrictModel):
    """One throughput sweep against one server (`draftsmith sweep`, `draftsmith.evals.sweep`)."""

    concurrency: tuple[int, ...] = Field(DEFAULT_CONCURRENCY, min_length=1, description="Levels, requests in flight.")
    requests_per_level: int = Field(128, ge=1, description="Requests sent at each level; at least max concurrency.")
    prompts: tuple[str, ...] = Field(DEFAULT_PROMPTS, min_length=1, description="User turns, cycled over requests.")
    max_tokens: int = Field(128, ge=1, description="Output tokens per request.")
    ignore_eos: bool = Field(True, description="Generate max_tokens every time, so runs compare the same work.")
    temperature: float = Field(0.0, ge=0.0, description="Sampling temperature; 0 is greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    warmup_requests: int = Field(2, ge=0, description="Requests before the first level, left out of every figure.")
    timeout_s: float = Field(1800.0, gt=0, description="Wall-clock limit per concurrency level, in seconds.")
    seed: int = Field(0, description="Seed of the load generator.")
    max_model_len: int = Field(2048, gt=0, description="The server's context: longest prompt plus answer, in tokens.")

    _levels = field_validator("concurrency")(_distinct_levels)

    @field_validator("prompts")
    @classmethod
    def _prompts(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        empty = [i for i, p in enumerate(v) if not p.strip()]
        if empty:
            raise ValueError(f"prompts: entries {empty} are empty")
        return v

    @model_validator(mode="after")
    def _saturate(self) -> SweepConfig:
        if self.requests_per_level < max(self.concurrency):
            raise ValueError(
                f"requests_per_level: {self.requests_per_level} cannot keep concurrency {max(self.concurrency)} busy"
            )
        return self


class SpeedupConfig(StrictModel):
    """Speculation on against off in one engine (`draftsmith speedup`, `evals.speedup`): two servers of the same
    target, the same prompts sent to each in turn (off, on, off, on, ...) so that machine load hits both alike."""

    concurrency: tuple[int, ...] = Field((1, 4), min_length=1, description="Levels, requests in flight.")
    rounds: int = Field(2, ge=1, description="Timed off/on pairs per level, interleaved.")
    requests: int = Field(8, ge=1, description="Requests per timed run; at least the highest concurrency.")
    max_tokens: int = Field(64, ge=1, description="Output tokens per request (end of turn ignored).")
    max_prompts: int = Field(48, ge=1, description="Prompts drawn round-robin from the run's evaluation benchmarks.")
    warmup_requests: int = Field(2, ge=0, description="Untimed requests to each server before its first timed run.")
    timeout_s: float = Field(1800.0, gt=0, description="Wall-clock limit for all timed runs together, in seconds.")
    max_model_len: int = Field(2048, gt=0, description="The servers' context: longest prompt plus answer, in tokens.")
    draft_tokens: tuple[int, ...] | None = Field(
        None,
        min_length=1,
        description="Serving depths to measure side by side, one speculating server each: draft tokens a chain "
        "drafter proposes per step. Null: the run's `evaluate.num_draft_tokens`. A block drafter's export "
        "fixes its own, so it takes none.",
    )

    _levels = field_validator("concurrency")(_distinct_levels)

    @field_validator("draft_tokens")
    @classmethod
    def _depths(cls, v: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if v is not None and (any(d < 1 for d in v) or len(set(v)) != len(v)):
            raise ValueError(f"draft_tokens: depths must be distinct positive integers, got {list(v)}")
        return None if v is None else tuple(sorted(v))

    @model_validator(mode="after")
    def _saturate(self) -> SpeedupConfig:
        if self.requests < max(self.concurrency):
            raise ValueError(f"requests: {self.requests} cannot keep concurrency {max(self.concurrency)} busy")
        return self
