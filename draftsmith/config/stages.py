"""One config section per pipeline stage, plus the target, storage and resources (the drafter: `drafter.py`).

Cross-section rules (taps against the target's layer count, for instance) live in
`draftsmith.config.pipeline`, because a section cannot see its siblings.
"""

from typing import Literal

from pydantic import Field

from draftsmith.config.base import StrictModel


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


class EvaluateConfig(StrictModel):
    """Real speculative decoding of the held-out prompts, with and without the drafter."""

    num_draft_tokens: int = Field(
        3, ge=1, description="Draft chain length per round (chain drafters; a block drafter drafts its block)."
    )
    max_new_tokens: int = Field(64, gt=0, description="Tokens generated per held-out prompt.")
    max_prompts: int | None = Field(None, gt=0, description="Evaluate at most this many held-out prompts.")
    verification: Literal["greedy"] = Field("greedy", description="Verification rule.")
    resources: Resources = Field(default_factory=Resources, description="Where this stage runs.")
