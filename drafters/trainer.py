"""In-process drafter training on one device (CPU here), for any drafter family. FSDP2 arrives in issue #6.

The loop knows nothing of the family: an objective maps `(model, batch)` to a `StepLoss`
(`drafters.families` builds one per family), so EAGLE-3, DFlash2 and DSpark share the optimiser, schedule,
clipping and per-step history.

Shape legend: B batch, S sequence.
"""

import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from drafters.data import TrainSample, collate
from drafters.objective import StepLoss, simulated_acc_len
from draftsmith.config import TrainConfig

Objective = Callable[[torch.nn.Module, dict[str, torch.Tensor]], StepLoss]

log = logging.getLogger(__name__)


@dataclass
class TrainReport:
    """Per-step history and the final figures."""

    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    history: list[dict] = field(default_factory=list)

    def record(self, epoch: int, tokens: int, out: StepLoss, grad_norm: float, lr: float) -> None:
        """Append one optimizer step to the history (and log every 20th)."""
        self.steps += 1
        self.tokens += tokens
        h = {
            "step": self.steps,
            "epoch": epoch,
            "loss": float(out.total.detach()),
            "acc": [round(float(a), 5) for a in out.step_acc],
            "grad_norm": grad_norm,
            "lr": lr,
        }
        self.history.append(h)
        if self.steps % 20 == 0 or self.steps == 1:
            log.info("train: step %d epoch %d loss %.4f acc %s", h["step"], epoch, h["loss"], h["acc"])

    def final(self, last: int = 10) -> dict[str, float]:
        """Means over the last `last` steps (the end-of-training loss and accuracies)."""
        tail = self.history[-last:]
        depth = len(tail[0]["acc"])
        acc = [sum(h["acc"][k] for h in tail) / len(tail) for k in range(depth)]
        out = {"loss": sum(h["loss"] for h in tail) / len(tail)}
        out |= {f"acc_{k}": a for k, a in enumerate(acc)}
        out["simulated_acc_len"] = simulated_acc_len(torch.tensor(acc))
        return out


def lr_lambda(warmup: int, total: int, floor: float = 0.1) -> Callable[[int], float]:
    """Linear warm-up, then cosine decay to `floor` times the peak."""

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def train_drafter(
    model: torch.nn.Module,
    batches: Iterable[tuple[int, list[TrainSample]]],
    total_steps: int,
    objective: Objective,
    cfg: TrainConfig,
    *,
    seed: int,
) -> TrainReport:
    """Train `model` in place, one optimizer step per `(epoch, samples)` of `batches`.

    `batches` come from the offline store's prefetching loader or the online stream alike; `total_steps`
    sizes the LR schedule. Frozen parameters (the target's embedding, a shared lm_head) stay out of AdamW.
    """
    torch.manual_seed(seed)
    torch.set_num_threads(cfg.threads)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg.warmup_steps, max(1, total_steps)))
    report = TrainReport()
    start = time.perf_counter()
    model.train()
    for epoch, samples in batches:
        batch = collate(samples)
        out = objective(model, batch)
        opt.zero_grad(set_to_none=True)
        out.total.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        sched.step()
        report.record(epoch, int(batch["input_ids"].numel()), out, float(grad_norm), sched.get_last_lr()[0])
    model.eval()
    report.seconds = time.perf_counter() - start
    return report
