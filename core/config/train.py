"""The training section: batching, optimiser and schedule, FSDP2 and torchrun, checkpoints and metrics.

One trainer runs on 1 CPU process, 2 gloo ranks or N NCCL nodes; this section is everything that differs.
"""

from typing import Literal

from pydantic import Field, model_validator

from draftsmith.core.config.base import StrictModel
from draftsmith.core.config.stages import Resources

Dtype = Literal["float32", "bfloat16"]


class DistributedConfig(StrictModel):
    """How the `train` task launches `torchrun` (one launch per node)."""

    nnodes: int = Field(1, ge=1, description="Nodes in the job; keep equal to `train.resources.nodes`.")
    nproc_per_node: int = Field(1, ge=1, description="Ranks per node (GPUs per node on GPU pools).")
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="Process-group backend; `auto` is NCCL when CUDA is present, gloo otherwise."
    )
    rdzv_endpoint: str | None = Field(
        None,
        description="`host:port` of the c10d rendezvous for multi-node jobs; on the gb200-train pool the job "
        "template sets DRAFTSMITH_RDZV_ENDPOINT instead. Single-node jobs use `--standalone`.",
    )
    timeout_s: int = Field(
        600, ge=10, description="Collective timeout: a rank that stops answering fails the job after this."
    )


class MixedPrecisionConfig(StrictModel):
    """FSDP2's `MixedPrecisionPolicy`; the optimiser always keeps fp32 master weights."""

    param_dtype: Dtype = Field(
        "float32", description="Dtype of the all-gathered parameters in forward/backward (bf16 on GPU)."
    )
    reduce_dtype: Dtype = Field("float32", description="Dtype gradients are reduce-scattered in.")


class CheckpointConfig(StrictModel):
    """Distributed (DCP) checkpoints the run resumes from after a crash."""

    every_steps: int = Field(200, ge=0, description="Save every this many optimizer steps (0: never).")
    keep: int = Field(2, ge=1, description="Newest checkpoints kept; older ones are deleted after a save.")


class MetricsConfig(StrictModel):
    """Where step metrics go besides `metrics.jsonl`."""

    log_every: int = Field(20, ge=1, description="Log (and write to TensorBoard) every this many steps.")
    tensorboard: bool = Field(False, description="Also write TensorBoard event files under the stage folder.")
    peak_flops: float | None = Field(
        None, gt=0, description="Per-rank peak FLOP/s for MFU; default: the device's table value or a measured matmul."
    )


class TrainConfig(StrictModel):
    """Drafter training with the FSDP2 trainer (`draftsmith.drafters.training`), launched through torchrun."""

    epochs: int = Field(2, gt=0, description="Passes over the training samples.")
    lr: float = Field(1e-3, gt=0.0, description="Peak AdamW learning rate.")
    schedule: Literal["cosine", "linear", "constant", "wsd"] = Field(
        "cosine", description="LR shape after the linear warm-up (`wsd`: warmup-stable-decay)."
    )
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="Final LR as a fraction of `lr` (cosine/linear/wsd).")
    wsd_decay_fraction: float = Field(
        0.2, gt=0.0, le=1.0, description="`wsd` only: share of the steps spent in the final linear decay."
    )
    warmup_steps: int = Field(10, ge=0, description="Linear warm-up steps.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0.0, description="Global gradient-norm clip.")
    optimizer_impl: Literal["auto", "fused", "foreach"] = Field(
        "auto", description="AdamW kernel: `auto` is fused where the device supports it, foreach elsewhere."
    )
    batch_tokens: int = Field(4096, gt=0, description="Padded-token budget of one micro-batch on one rank.")
    grad_accum: int = Field(1, ge=1, description="Micro-batches per rank per optimizer step.")
    chunk_samples: int = Field(
        2048, ge=1, description="Length grouping window: samples sorted longest-first together after the shuffle."
    )
    min_loss_tokens: int = Field(
        1, ge=1, description="A sample with fewer loss tokens trains with a zero mask (kept, so ranks stay in step)."
    )
    prompt_loss: bool = Field(
        False,
        description="Also fit the target's distribution at prompt positions (after the first token), not only at "
        "the answer's: the same function, seen on the text a request carries (a stub, a passage), at no "
        "extra capture. The sample still needs `min_loss_tokens` answer tokens to count.",
    )
    max_consecutive_skips: int = Field(
        10,
        ge=1,
        description="Fail the run after this many optimizer steps in a row with a non-finite loss or gradient.",
    )
    compile: bool = Field(False, description="`torch.compile` each drafter layer.")
    kernels: Literal["auto", "reference"] = Field(
        "auto",
        description="Hot-spot kernels (`kernels/`: fused head loss, RMSNorm, DFlash2 conv): `auto` runs the Triton "
        "kernels on CUDA and the PyTorch reference elsewhere; `reference` runs the reference everywhere.",
    )
    threads: int | None = Field(
        None, ge=1, description="torch threads per rank; default `resources.cpus // distributed.nproc_per_node`."
    )
    loader_workers: int = Field(2, ge=1, description="Threads reading hidden-state batches ahead of the step.")
    prefetch: int = Field(4, ge=1, description="Micro-batches read ahead of the training step.")
    distributed: DistributedConfig = Field(default_factory=DistributedConfig, description="torchrun launch.")
    mixed_precision: MixedPrecisionConfig = Field(default_factory=MixedPrecisionConfig, description="FSDP2 dtypes.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="DCP checkpoints.")
    metrics: MetricsConfig = Field(default_factory=MetricsConfig, description="Metric sinks.")
    resources: Resources = Field(default_factory=Resources, description="Where this stage runs.")

    @model_validator(mode="after")
    def _launch_fits(self) -> "TrainConfig":
        d, r = self.distributed, self.resources
        if d.nnodes != r.nodes:
            raise ValueError(f"train.distributed.nnodes: {d.nnodes} differs from train.resources.nodes ({r.nodes})")
        if r.gpus and d.nproc_per_node != r.gpus:
            raise ValueError(
                f"train.distributed.nproc_per_node: {d.nproc_per_node} ranks on {r.gpus} GPUs per node "
                "(train.resources.gpus); one rank drives one GPU"
            )
        if not r.gpus and d.backend == "nccl":
            raise ValueError("train.distributed.backend: nccl needs GPUs (train.resources.gpus is 0)")
        return self

    @property
    def world_size(self) -> int:
        return self.distributed.nnodes * self.distributed.nproc_per_node

    def rank_threads(self) -> int:
        """torch threads per rank: `threads`, or the stage's cores split between the node's ranks."""
        return self.threads or max(1, self.resources.cpus // self.distributed.nproc_per_node)
