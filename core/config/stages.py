"""One config section per pipeline stage, plus the target, storage and resources (the drafter: `drafter.py`).

Cross-section rules (taps against the target's layer count, for instance) live in
`draftsmith.core.config.pipeline`, because a section cannot see its siblings.
"""

from typing import Literal

from pydantic import Field, model_validator

from draftsmith.core.config.base import StrictModel


class Resources(StrictModel):
    """Where a stage runs and what it may use; `draftsmith plan` prints these."""

    work_pool: str = Field("local", min_length=1, description="Prefect work pool that runs this stage.")
    cpus: int = Field(2, ge=1, description="CPU cores the stage may use.")
    gpus: int = Field(0, ge=0, description="GPUs per node (0 on CPU pools).")
    nodes: int = Field(1, ge=1, description="Number of nodes.")
    memory_gb: int = Field(16, ge=1, description="Host memory per node, GiB.")


class TargetConfig(StrictModel):
    """The target LLM whose drafter is trained. Its shape is declared so recipes validate offline."""

    name: str = Field(min_length=1, description="Human-readable target name, recorded in every manifest.")
    source: str = Field(
        min_length=1,
        description="`embedded:<name>` (built by `draftsmith setup-target`), a local HF folder, "
        "or a model id served by a remote engine.",
    )
    num_layers: int = Field(gt=0, description="Decoder layer count; taps must be below it.")
    hidden_size: int = Field(gt=0, description="Residual stream width H.")
    vocab_size: int = Field(gt=0, description="Target vocabulary size V.")
    compute_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Dtype the target computes in (fp32 on CPU: no bf16 units there)."
    )
    trust_remote_code: bool = Field(False, description="Allow code shipped with the model. Off unless opted in.")


class StorageConfig(StrictModel):
    """Where runs live."""

    run_root: str = Field(
        "runs",
        min_length=1,
        description="Local folder or fsspec URL under which `<recipe name>/` is created.",
    )
    lock_lease_s: float = Field(
        120.0,
        ge=10.0,
        le=3600.0,
        allow_inf_nan=False,
        description="Lease of an object-store run folder's lock: renewed every third of it while a run holds the "
        "folder; a killed run's lease is taken over once it has expired. Keep it well above clock skew.",
    )


class DispatchConfig(StrictModel):
    """How a flow run watches the stages it dispatches to other pools (`stage/<pool>` flow runs).

    A dispatched stage writes a heartbeat into the run folder; a flow run that stays Running while its
    heartbeat stands still (its worker's node lost, the process killed) is marked Crashed and dispatched
    again or reported, instead of being waited for forever.
    """

    heartbeat_s: float = Field(
        10.0, ge=0.5, le=600.0, allow_inf_nan=False, description="A dispatched stage writes its heartbeat this often."
    )
    lost_after_s: float = Field(
        120.0,
        ge=2.0,
        le=86400.0,
        allow_inf_nan=False,
        description="A Running dispatched stage whose heartbeat has not changed for this long is lost: marked "
        "Crashed, then dispatched again (`retries`) or the run fails naming it. At least twice `heartbeat_s`.",
    )
    retries: int = Field(0, ge=0, le=10, description="Times a lost dispatched stage is dispatched again.")

    @model_validator(mode="after")
    def _lost_after_heartbeats(self) -> "DispatchConfig":
        if self.lost_after_s < 2 * self.heartbeat_s:
            raise ValueError(
                f"lost_after_s ({self.lost_after_s} s) is less than two heartbeats "
                f"(heartbeat_s: {self.heartbeat_s} s); a live stage would be declared lost"
            )
        return self


class EvaluateConfig(StrictModel):
    """Real speculative decoding of benchmark prompts, with and without the drafter, in the same run."""

    num_draft_tokens: int = Field(
        3, ge=1, description="Draft chain length per round (chain drafters; a block drafter drafts its block)."
    )
    max_new_tokens: int = Field(64, gt=0, description="Tokens generated per prompt and turn.")
    max_prompts: int | None = Field(None, gt=0, description="Evaluate at most this many held-out prompts.")
    batch_size: int = Field(
        1, ge=1, le=64, description="Prompts decoded together (one target forward verifies every row each round)."
    )
    temperature: float = Field(0.0, ge=0.0, description="Sampling temperature of target and drafter (0: greedy).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass, applied to target and drafter alike.")
    verification: Literal["greedy", "token", "block"] = Field(
        "greedy",
        description="Verification rule: greedy (temperature 0), token (speculative sampling) or block (Sun et al.).",
    )
    suites: list[str] = Field(
        default_factory=lambda: ["all"],
        description="Built-in benchmark suites (categories) to run, `all`, or [] for none.",
    )
    prompts_per_suite: int = Field(4, ge=1, description="Prompts drawn per built-in suite.")
    held_out: bool = Field(True, description="Also evaluate the recipe's held-out prompts (benchmark `held-out`).")
    bench_files: dict[str, str] = Field(
        default_factory=dict, description="More benchmarks, name -> local path or s3:// URL (MT-Bench, GSM8K, ...)."
    )
    calibration_prompts: int = Field(
        2, ge=0, description="DSpark: prompts per built-in suite to calibrate the confidence head on (0: skip)."
    )
    confidence_threshold: float = Field(
        0.5, ge=0.0, le=1.0, description="DSpark dynamic verification: keep drafts while calibrated survival >= this."
    )
    doctor: bool = Field(
        True,
        description="Add `draftsmith doctor`'s findings to the results page every flow run publishes.",
    )

    @model_validator(mode="after")
    def _rule_fits_sampling(self) -> "EvaluateConfig":
        if self.verification == "greedy" and self.temperature > 0:
            raise ValueError(
                f"evaluate.verification: greedy verification with temperature {self.temperature} is not lossless; "
                "use token or block"
            )
        if self.verification != "greedy" and self.temperature == 0:
            raise ValueError(f"evaluate.verification: {self.verification} needs temperature > 0 (greedy at 0)")
        return self

    resources: Resources = Field(default_factory=Resources, description="Where this stage runs.")
