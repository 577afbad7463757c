"""The serving throughput sweep's settings: concurrency levels, requests, prompts and sampling."""

from __future__ import annotations

from typing import Literal

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


class NgramSettings(StrictModel):
    """vLLM's n-gram prompt lookup (`method: ngram`): drafts the tokens that followed the longest earlier match
    of the last n tokens in the prompt and the answer so far. No model, no training."""

    num_speculative_tokens: int = Field(3, ge=1, description="Tokens drafted per step when a match is found.")
    prompt_lookup_min: int = Field(2, ge=1, description="Shortest n-gram matched.")
    prompt_lookup_max: int = Field(4, ge=1, description="Longest n-gram matched (tried first).")

    @model_validator(mode="after")
    def _order(self) -> NgramSettings:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"ngram.prompt_lookup_min: {self.prompt_lookup_min} exceeds prompt_lookup_max "
                f"({self.prompt_lookup_max})"
            )
        return self


class SuffixSettings(StrictModel):
    """vLLM's suffix decoding (`method: suffix`, Arctic Inference's suffix trees): drafts from suffix trees over
    the prompt and over earlier answers of the same server. No model, no training."""

    num_speculative_tokens: int | None = Field(
        None, ge=1, description="Most tokens drafted per step; null: vLLM's default (the tree depth, 24)."
    )
    max_cached_requests: int | None = Field(
        None, ge=0, description="Earlier answers kept in the global tree (0: prompt trees only); null: vLLM's default."
    )


FreeMethod = Literal["ngram", "suffix"]


class SpeedupConfig(StrictModel):
    """A trained drafter against plain serving and against the engine's free speculation, in one engine
    (`draftsmith speedup`, `evals.speedup`): one server each, the same prompts sent to each in turn so that
    machine load hits all alike."""

    concurrency: tuple[int, ...] = Field((1, 2, 4, 8), min_length=1, description="Levels, requests in flight.")
    rounds: int = Field(2, ge=1, description="Timed runs per server and level, interleaved with the other servers'.")
    waves: int = Field(
        4,
        ge=1,
        description="Requests per timed run, as a multiple of the level's concurrency: every run keeps the server "
        "full for about the same number of batches, and a run's straggling last requests weigh the same at "
        "every level.",
    )
    max_tokens: int = Field(64, ge=1, description="Output tokens per request (end of turn ignored).")
    warmup_requests: int = Field(2, ge=0, description="Untimed requests to each server before its first timed run.")
    held_out: bool = Field(
        False,
        description="Also send the run's held-out prompts. Off: the built-in suites and `evaluate.bench_files`, "
        "which share no template with the training prompts.",
    )
    free_methods: tuple[FreeMethod, ...] = Field(
        ("ngram", "suffix"),
        description="Training-free speculation measured beside the drafter, one server each. A method the installed "
        "vLLM cannot run is reported as skipped, with the reason.",
    )
    ngram: NgramSettings = Field(default_factory=NgramSettings, description="The `ngram` server's settings.")
    suffix: SuffixSettings = Field(default_factory=SuffixSettings, description="The `suffix` server's settings.")
    timeout_s: float = Field(3600.0, gt=0, description="Wall-clock limit for all timed runs together, in seconds.")
    max_model_len: int = Field(2048, gt=0, description="The servers' context: longest prompt plus answer, in tokens.")
    compile: bool = Field(
        True,
        description="Serve with vLLM's graph compilation. False adds --enforce-eager to every measured server and "
        "to the command `draftsmith export` prints, so that what is served is what was measured: each server "
        "starts a minute or more sooner on CPU, at the cost of Python's per-operation overhead on every step.",
    )
    draft_tokens: tuple[int, ...] | None = Field(
        None,
        min_length=1,
        description="Serving depths to measure side by side, one speculating server each: draft tokens a chain "
        "drafter proposes per step. The depth that is fastest at each level makes the served schedule "
        "(`draftsmith export`). Null: the run's `evaluate.num_draft_tokens`. A block drafter's export fixes "
        "its own, so it takes none.",
    )

    _levels = field_validator("concurrency")(_distinct_levels)

    @field_validator("draft_tokens")
    @classmethod
    def _depths(cls, v: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if v is not None and (any(d < 1 for d in v) or len(set(v)) != len(v)):
            raise ValueError(f"draft_tokens: depths must be distinct positive integers, got {list(v)}")
        return None if v is None else tuple(sorted(v))

    @field_validator("free_methods")
    @classmethod
    def _methods(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(v)) != len(v):
            raise ValueError(f"free_methods: each method once, got {list(v)}")
        return v

    def requests(self, concurrency: int) -> int:
        """Requests in one timed run at `concurrency`."""
        return self.waves * concurrency

    def prompts_needed(self) -> int:
        """Distinct prompts for one measurement: the warm-up's and every round's of every level."""
        return self.warmup_requests + self.rounds * sum(self.requests(c) for c in self.concurrency)
