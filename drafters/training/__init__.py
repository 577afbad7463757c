"""The FSDP2 drafter trainer: one code path on 1 CPU process, 2 gloo ranks or N NCCL nodes.

`worker` is the torchrun entry point; `plan` (length-grouped, rank-balanced batches), `fsdp` (meta init and
sharding), `loop` (the step), `checkpoint` (DCP with rotation), `metrics`, `schedule` and `flops` are its parts.
"""
