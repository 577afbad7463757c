"""The optimizer step: gradient accumulation, clipping, a fused AdamW that skips non-finite steps on device.

Nothing here waits for the device. Losses, accuracies and the gradient norm stay tensors; one vector per
step is all-reduced, copied to the host without blocking (`metrics.DeferredMetrics`) and read a step late.
A non-finite step is skipped inside the fused AdamW kernel (its `found_inf` input, the mechanism
`torch.amp.GradScaler` uses), and the consecutive-skip count lives on the device too; the host notices a
run of `max_consecutive_skips` one step late and fails. The `foreach` AdamW has no such input, so on
devices without a fused kernel the skip costs one host sync per step. A run too short to reach that limit
still fails when it ends in a long run of skipped steps or with non-finite weights (`Trainer.check_finished`),
so a diverged drafter is never exported as if it had trained.

Shape legend: K slots (TTT depths or block positions), M metric values.
"""

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from draftsmith.core.config.train import TrainConfig
from draftsmith.drafters.training.fsdp import Dist, TrainModule
from draftsmith.drafters.training.metrics import DeferredMetrics
from draftsmith.drafters.training.schedule import lr_lambda


class NonFiniteError(RuntimeError):
    """Training diverged: too many optimizer steps in a row had a non-finite loss or gradient, the run ended
    in such a streak, or the weights are no longer finite."""


@dataclass(frozen=True)
class Micro:
    """One micro-batch as a rank trains it: the collated tensors and the seed of the objective's randomness."""

    batch: dict[str, torch.Tensor]
    seed: int


def micro_seed(seed: int, epoch: int, indices: Sequence[int]) -> int:
    """A seed that depends on the micro-batch's samples only, so any rank that trains it draws the same anchors."""
    return zlib.crc32(repr((seed, epoch, tuple(indices))).encode())


def metric_names(slots: int) -> list[str]:
    """The step vector's layout (sums over ranks and micro-batches; `Trainer.finish` turns them into means)."""
    per_slot = [f"{m}_{k}" for m in ("loss", "acc", "count") for k in range(slots)]
    return ["loss", *per_slot, "grad_norm", "finite", "consecutive_skips", "skipped_steps", "loss_tokens", "tokens"]


def make_optimizer(params: list[torch.nn.Parameter], cfg: TrainConfig) -> tuple[torch.optim.AdamW, bool]:
    """AdamW over the fp32 master shards: fused where supported (CUDA, CPU), else foreach."""
    fused = cfg.optimizer_impl == "fused" or (cfg.optimizer_impl == "auto" and params[0].device.type in ("cuda", "cpu"))
    kwargs = {"fused": True} if fused else {"foreach": True}
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay, **kwargs)
    return opt, fused


class Trainer:
    """Owns the optimizer, schedule and on-device counters of one sharded `TrainModule`."""

    def __init__(self, module: TrainModule, cfg: TrainConfig, d: Dist, total_steps: int, generator: torch.Generator):
        self.module, self.cfg, self.d, self.generator = module, cfg, d, generator
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.opt, self.fused = make_optimizer(self.params, cfg)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(cfg, max(1, total_steps)))
        self.step = 0
        self.consecutive = torch.zeros((), device=d.device)
        self.skipped = torch.zeros((), device=d.device)
        self.slots: int | None = None
        self.deferred: DeferredMetrics | None = None
        self.streak = 0  # skipped steps in a row at the last step `finish` saw, agreed by every rank

    def train_step(self, micros: list[Micro]) -> dict | None:
        """One optimizer step over this rank's micro-batches; returns the previous step's metrics (or None)."""
        sums: torch.Tensor | None = None
        for i, micro in enumerate(micros):
            cast(FSDPModule, self.module).set_requires_gradient_sync(i == len(micros) - 1)  # sharded by `shard`
            self.generator.manual_seed(micro.seed)
            total, loss_K, acc_K, count_K = self.module(micro.batch)
            (total / len(micros)).backward()
            part = torch.cat([total.detach()[None], loss_K.detach() * count_K, acc_K.detach() * count_K, count_K])
            sums = part if sums is None else sums + part
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip, foreach=True)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        assert sums is not None, "a step has at least one micro-batch"
        finite = torch.isfinite(grad_norm) & torch.isfinite(sums[0])
        self._optimizer_step(finite)
        self.consecutive = (self.consecutive + 1) * (~finite)
        self.skipped = self.skipped + (~finite)
        tokens = sum(m.batch["input_ids"].numel() for m in micros)
        loss_tokens = torch.stack([m.batch["loss_mask"].sum() for m in micros]).sum()
        vec = torch.cat(
            [sums, torch.stack([grad_norm, finite.float(), self.consecutive, self.skipped]).float()]
            + [torch.stack([loss_tokens.float(), torch.tensor(float(tokens), device=sums.device)])]
        )
        return self._push(vec.to(self.d.device), (len(vec) - 7) // 3)

    def _optimizer_step(self, finite: torch.Tensor) -> None:
        if self.fused:
            # Read by the fused kernel (the update is skipped on device). torch's step reads them with getattr;
            # its stubs do not declare them.
            self.opt.found_inf = (~finite).float()  # type: ignore[attr-defined]
            self.opt.grad_scale = None  # type: ignore[attr-defined]
            self.opt.step()
            del self.opt.found_inf, self.opt.grad_scale  # type: ignore[attr-defined]
        elif bool(finite):  # the foreach kernel cannot skip by itself: one host sync
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.sched.step()
        self.step += 1

    def _push(self, vec: torch.Tensor, slots: int) -> dict | None:
        if self.d.world > 1:
            dist.all_reduce(vec)
        if self.deferred is None:
            self.slots = slots
            self.deferred = DeferredMetrics(metric_names(slots), self.d.device)
        return self.finish(self.deferred.push(self.step, vec))

    def flush(self) -> dict | None:
        """The last step's metrics, after the loop."""
        return self.finish(self.deferred.flush()) if self.deferred is not None else None

    def finish(self, raw: dict | None) -> dict | None:
        """Turn a step's summed vector into means; fail on a run of non-finite steps."""
        if raw is None:
            return None
        w, K = self.d.world, self.slots
        assert K is not None, "set by the step that pushed `raw`"
        counts = [raw[f"count_{k}"] for k in range(K)]
        out = {
            "step": raw["step"],
            "loss": raw["loss"] / (w * self.cfg.grad_accum),
            "slot_loss": [raw[f"loss_{k}"] / max(c, 1.0) for k, c in enumerate(counts)],
            "acc": [raw[f"acc_{k}"] / max(c, 1.0) for k, c in enumerate(counts)],
            "grad_norm": raw["grad_norm"] / w,
            "skipped": raw["finite"] / w < 0.5,
            "skipped_steps": int(round(raw["skipped_steps"] / w)),
            "loss_tokens": int(raw["loss_tokens"]),
            "tokens": int(raw["tokens"]),
            "lr": self.sched.get_last_lr()[0],
        }
        consecutive = int(round(raw["consecutive_skips"] / w))
        self.streak = consecutive
        if consecutive >= self.cfg.max_consecutive_skips:
            raise NonFiniteError(
                f"train: {consecutive} optimizer steps in a row (up to step {raw['step']}) had a non-finite loss or "
                f"gradient (train.max_consecutive_skips = {self.cfg.max_consecutive_skips}); {self._advice()}"
            )
        return out

    def _advice(self) -> str:
        return f"lower train.lr (now {self.cfg.lr:g}) or look for broken samples"

    def check_finished(self) -> None:
        """Fail a run that ends diverged; every rank calls it (it all-reduces).

        A streak of `max_consecutive_skips` fails in `finish`, but a short run ends before it gets there,
        so a final streak of half the run or more fails here. Skipped steps leave the weights as they were,
        which can already be non-finite (an update that overflowed): that fails too.
        """
        if self.streak and self.streak >= min(self.cfg.max_consecutive_skips, math.ceil(self.step / 2)):
            raise NonFiniteError(
                f"train: the last {self.streak} of {self.step} optimizer steps (steps {self.step - self.streak + 1}"
                f"-{self.step}) had a non-finite loss or gradient and training never recovered; {self._advice()}"
            )
        bad = torch.zeros((), device=self.d.device)
        for p in self.params:
            local = p.to_local() if isinstance(p, DTensor) else p
            bad = bad + (~torch.isfinite(local.detach())).any()
        if self.d.world > 1:
            dist.all_reduce(bad)
        if bool(bad):
            raise NonFiniteError(
                f"train: after step {self.step} the drafter's weights are not finite; {self._advice()}"
            )

    def state(self) -> dict:
        """What a checkpoint keeps besides model and optimizer (JSON-able)."""
        return {
            "step": self.step,
            "consecutive_skips": float(self.consecutive),
            "skipped_steps": float(self.skipped),
            "scheduler": self.sched.state_dict(),
        }

    def load_state(self, state: dict) -> None:
        self.step = state["step"]
        self.consecutive.fill_(state["consecutive_skips"])
        self.skipped.fill_(state["skipped_steps"])
        self.sched.load_state_dict(state["scheduler"])
