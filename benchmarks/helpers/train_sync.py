"""Part 2 of `benchmarks.train`: the trainer's step against the same step with host syncs and foreach AdamW.

Both variants train one EAGLE-3 drafter, built by the trainer's own path (`draftsmith.drafters.training.worker.build`)
in a process group of one, on the same micro-batches, and alternate in rounds so machine noise hits both.

- ours: `Trainer.train_step` (fused AdamW that skips non-finite steps on device, metrics read a step late);
- synced: per micro-batch `loss.item()`, then `grad_norm.item()`, a host-side finite check deciding whether
  to step, and AdamW(foreach=True): the loop most training scripts write.

Shape legend: B batch, S sequence.
"""

import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from benchmarks.helpers.timing import best_of
from benchmarks.helpers.train_data import SampleMaker, lognormal_lengths, loss_counts
from draftsmith.core import storage, tensorio
from draftsmith.drafters import data, families
from draftsmith.drafters.training import fsdp
from draftsmith.drafters.training.loop import Micro, Trainer, micro_seed
from draftsmith.drafters.training.plan import plan_epoch
from draftsmith.drafters.training.target_parts import load_target_parts
from draftsmith.drafters.training.worker import TrainJob, build


@dataclass(frozen=True)
class SyncResult:
    ours_tokens_per_s: float
    synced_tokens_per_s: float
    tokens_per_step: int
    rounds: int
    steps_per_round: int
    fused_opt_s: float  # one optimizer step alone, fused AdamW
    foreach_opt_s: float  # the same, foreach AdamW

    @property
    def ratio(self) -> float:
        """Throughput of ours over the synced loop (> 1: ours is faster)."""
        return self.ours_tokens_per_s / self.synced_tokens_per_s


def synced_step(built, opt: torch.optim.Optimizer, sched, micros: list[Micro], grad_clip: float) -> float:
    """The naive step: a host sync per micro-batch loss, one on the grad norm, foreach AdamW."""
    losses = []
    for i, micro in enumerate(micros):
        built.module.set_requires_gradient_sync(i == len(micros) - 1)
        built.generator.manual_seed(micro.seed)
        total = built.module(micro.batch)[0]
        (total / len(micros)).backward()
        losses.append(total.item())
    params = [p for p in built.module.parameters() if p.requires_grad]
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip, foreach=True)
    norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    if math.isfinite(norm.item()) and all(math.isfinite(x) for x in losses):
        opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()
    return sum(losses) / len(losses)


def make_micros(recipe, steps: int, *, max_len: int, seed: int) -> tuple[list[list[Micro]], torch.Tensor]:
    """`steps` optimizer steps of planned micro-batches (budget `recipe.train.batch_tokens`) and `[V]` counts."""
    cfg, target = recipe.train, recipe.target
    parts = load_target_parts(target, materialize=True)
    embed = families.weight_of(parts.get_input_embeddings())
    maker = SampleMaker(embed.detach(), len(recipe.hidden_states.taps), seed)
    del parts
    n = 4 * steps * cfg.grad_accum * max(1, cfg.batch_tokens // max_len)
    lengths = lognormal_lengths(n, median=max_len / 3, sigma=0.8, lo=16, hi=max_len, seed=seed)
    samples = list(maker.samples(lengths))
    plan = plan_epoch(lengths, budget=cfg.batch_tokens, world=1, grad_accum=cfg.grad_accum,
                      chunk_samples=cfg.chunk_samples, seed=seed, epoch=0)  # fmt: skip
    if plan.num_steps < steps:
        raise RuntimeError(f"benchmarks.train: {n} samples planned into {plan.num_steps} < {steps} steps")
    out = []
    for step in plan.for_rank(0)[:steps]:
        micros = [Micro(data.collate([samples[i] for i in mb.indices]), micro_seed(seed, 0, mb.indices)) for mb in step]
        out.append(micros)
    return out, loss_counts(samples, target.vocab_size)


def _build(recipe, counts: torch.Tensor, folder: str, d: fsdp.Dist):
    counts_uri = storage.join(folder, "counts.safetensors")
    storage.write_bytes(counts_uri, tensorio.dumps({"counts": counts}))
    job = TrainJob(
        train=recipe.train.model_dump(mode="json"), drafter=recipe.drafter.model_dump(mode="json"),
        target=recipe.target.model_dump(mode="json"), hidden_cfg=recipe.hidden_states.model_dump(mode="json"),
        out_uri=folder, checkpoint_uri=storage.join(folder, "ckpt"), counts_uri=counts_uri, key="bench", seed=0,
    )  # fmt: skip
    return build(job, d)


def alternate(variants: dict[str, Callable[[], None]], rounds: int) -> dict[str, float]:
    """Fastest round per variant (seconds); the order flips every round so drifting load hits both alike."""
    best = dict.fromkeys(variants, float("inf"))
    names = list(variants)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            t = time.perf_counter()
            variants[name]()
            best[name] = min(best[name], time.perf_counter() - t)
    return best


def optimizer_seconds(opt: torch.optim.Optimizer, params: list, repeats: int = 5) -> float:
    """Fastest `opt.step()` over zero gradients (Adam's update is then zero: the weights stay put)."""
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()  # warm-up
    best = best_of(opt.step, repeats)
    opt.zero_grad(set_to_none=True)
    return best


def run_sync_bench(recipe, *, rounds: int, steps_per_round: int, max_len: int, threads: int = 2) -> SyncResult:
    """`rounds` alternating rounds of `steps_per_round` steps of each variant, after one warm-up step each."""
    torch.set_num_threads(threads)
    owned = not dist.is_initialized()
    d = fsdp.init_distributed(recipe.train.distributed)
    try:
        if d.world != 1:
            raise RuntimeError(f"benchmarks.train: the step benchmark runs in a group of one, got world {d.world}")
        return _measure(recipe, d, rounds, steps_per_round, max_len)
    finally:
        if owned:  # the torchrun parts that follow start their own groups in child processes
            dist.destroy_process_group()


def _measure(recipe, d: fsdp.Dist, rounds: int, steps_per_round: int, max_len: int) -> SyncResult:
    steps, counts = make_micros(recipe, steps_per_round, max_len=max_len, seed=0)
    cfg = recipe.train.model_copy(update={"optimizer_impl": "fused"})
    with tempfile.TemporaryDirectory(prefix="bench-train-") as folder:
        built = _build(recipe, counts, folder, d)
    trainer = Trainer(built.module, cfg, d, (rounds + 1) * steps_per_round, built.generator)
    if not trainer.fused:
        raise RuntimeError("benchmarks.train: the trainer did not pick the fused AdamW")
    params = [p for p in built.module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay, foreach=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)

    def ours() -> None:
        for micros in steps:
            trainer.train_step(micros)
        trainer.flush()  # the last step's metrics: the only wait, once per round

    def synced() -> None:
        for micros in steps:
            synced_step(built, opt, sched, micros, cfg.grad_clip)

    trainer.train_step(steps[0])
    trainer.flush()
    synced_step(built, opt, sched, steps[0], cfg.grad_clip)
    best = alternate({"ours": ours, "synced": synced}, rounds)
    tokens = sum(m.batch["input_ids"].numel() for micros in steps for m in micros)
    fused_s, foreach_s = optimizer_seconds(trainer.opt, params), optimizer_seconds(opt, params)
    return SyncResult(tokens / best["ours"], tokens / best["synced"], tokens // len(steps), rounds, steps_per_round,
                      fused_s, foreach_s)  # fmt: skip
