"""FSDP2 for drafters: the process group, meta-device init, per-layer sharding and the consolidated weights.

Every rank lays the drafter out on the meta device; rank 0 alone builds the real one (reading only the
target's embedding and head, `draftsmith.drafters.training.target_parts`) and its weights reach the other ranks'
shards by broadcast, so no rank but 0 ever holds a full copy.

Sharding units, each `fully_shard`ed before the root: the frozen target embedding (gathered for its lookup,
freed after), the lm_head, and every element of a `layers` list; everything else (EAGLE-3's single
midlayer, fc, norms, DSpark's heads, DFlash2's selector) is the root unit, which `TrainModule` wraps with the
objective so that the root's all-gather happens when the objective runs. A unit's methods that objectives
call outside its `forward` are named in the unit class's `fsdp_forward_methods` and registered with FSDP.
"""

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

from draftsmith.core.config.train import DistributedConfig, MixedPrecisionConfig
from draftsmith.drafters.objective import StepLoss

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Dist:
    """This process's place in the job."""

    rank: int
    world: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(cfg: DistributedConfig) -> Dist:
    """Join torchrun's process group (env `RANK`, `WORLD_SIZE`, ...), or form a group of one in-process."""
    cuda = torch.cuda.is_available() and cfg.backend != "gloo"
    if cfg.backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("train.distributed.backend: nccl, but this process sees no CUDA device")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        timeout = timedelta(seconds=cfg.timeout_s)
        backend = "nccl" if cuda else "gloo"
        if "RANK" in os.environ:
            dist.init_process_group(backend, timeout=timeout, device_id=device if cuda else None)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return Dist(dist.get_rank(), dist.get_world_size(), local_rank, device)


class TrainModule(nn.Module):
    """The root FSDP unit: a drafter and its objective; `forward(batch)` is one micro-batch's `StepLoss`.

    Returned as a tuple `(total, step_loss [K], step_acc [K], step_count [K])` so FSDP's hooks see tensors.
    """

    def __init__(self, drafter: nn.Module, objective) -> None:
        super().__init__()
        self.drafter = drafter
        self.objective = objective

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        out: StepLoss = self.objective(self.drafter, batch)
        # Fresh tensors, not views: FSDP hooks its backward onto what forward returns.
        return out.total.clone(), out.step_loss.clone(), out.step_acc.clone(), out.step_count.clone()


def shard_units(drafter: nn.Module) -> list[nn.Module]:
    """The drafter's own FSDP units (see the module docstring), in forward order."""
    embed, layers, head = drafter.embed_tokens, getattr(drafter, "layers", None), getattr(drafter, "lm_head", None)
    assert isinstance(embed, nn.Module)
    units = [embed]
    if isinstance(layers, nn.ModuleList):
        units += list(layers)
    if isinstance(head, nn.Linear):
        units.append(head)
    return units


def shard(module: TrainModule, mp: MixedPrecisionConfig, *, compile_layers: bool = False) -> TrainModule:
    """`fully_shard` each unit, then the root, with bf16/fp32 compute as the policy says (fp32 masters)."""
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[mp.param_dtype], reduce_dtype=DTYPES[mp.reduce_dtype])
    for unit in shard_units(module.drafter):
        if compile_layers and unit is not module.drafter.embed_tokens:
            unit.compile()
        fully_shard(unit, mp_policy=policy)
        for name in getattr(unit, "fsdp_forward_methods", ()):
            register_fsdp_forward_method(unit, name)
    fully_shard(module, mp_policy=policy)
    return module


def materialize(module: TrainModule, full: TrainModule | None, d: Dist) -> None:
    """Allocate the meta-device shards on `d.device` and fill them from rank 0's real module `full`.

    Other ranks pass None: weights arrive by broadcast, as do buffers no state dict holds.
    """
    module.to_empty(device=d.device)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    assert (full is not None) == d.is_main, "rank 0, and only rank 0, passes the real module"
    set_model_state_dict(module, full.state_dict() if full is not None else {}, options=options)
    persistent = set(module.state_dict())
    source = dict(full.named_buffers()) if full is not None else {}
    for name, buf in module.named_buffers():
        if name not in persistent:
            if d.is_main:
                buf.copy_(source[name])
            dist.broadcast(buf, src=0)


def consolidated(module: TrainModule) -> dict[str, torch.Tensor]:
    """The full drafter weights on rank 0's CPU (`{}` on other ranks), keys without the `drafter.` prefix.

    Collective: every rank must call it.
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(module, options=options)
    return {k.removeprefix("drafter."): cast(torch.Tensor, v) for k, v in full.items()}  # a module's: tensors
