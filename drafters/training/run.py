"""One rank's training run: its micro-batches, the step loop with checkpoints and metrics, the final export.

Shape legend: B batch, S sequence.
"""

import contextlib
import functools
import itertools
import logging
import os
import signal
import tempfile
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from draftsmith.core import storage
from draftsmith.core.config import HiddenStatesConfig, TargetConfig
from draftsmith.core.config.drafter import parse_drafter
from draftsmith.core.config.train import TrainConfig
from draftsmith.core.manifest import StageManifest, file_entry
from draftsmith.drafters import data, families
from draftsmith.drafters.objective import simulated_acc_len
from draftsmith.drafters.training import flops, fsdp
from draftsmith.drafters.training.checkpoint import Checkpoints
from draftsmith.drafters.training.loop import Micro, Trainer, micro_seed
from draftsmith.drafters.training.metrics import MetricsSink, summary_markdown
from draftsmith.drafters.training.plan import MicroBatch, plan_epoch, plan_training
from draftsmith.transport.mooncake_stream import StreamError
from draftsmith.transport.offline_reader import OfflineDataset, PrefetchLoader
from draftsmith.transport.online_source import OnlineSource
from draftsmith.transport.token_shards import token_samples

log = logging.getLogger("draftsmith.drafters.training")
# Fault injection for the resume test: rank 0 SIGKILLs torchrun and every rank right after this step.
FAULT_ENV = "DRAFTSMITH_FAULT_SIGKILL_AT_STEP"
Step = tuple[int, list[Micro]]  # (epoch, this rank's micro-batches of one optimizer step)


@dataclass
class RankBatches:
    """This rank's steps: `iterate(start)` yields them from optimizer step `start` on."""

    total_steps: int
    num_samples: int
    iterate: Callable[[int], Generator[Step, None, None]]


def _micro(samples: list, mb: MicroBatch, epoch: int, cfg: TrainConfig, seed: int, device) -> Micro:
    batch = data.collate(
        samples, zero_mask=mb.padding, min_loss_tokens=cfg.min_loss_tokens, prompt_loss=cfg.prompt_loss
    )
    return Micro({k: v.to(device, non_blocking=True) for k, v in batch.items()}, micro_seed(seed, epoch, mb.indices))


def offline_batches(job, cfg: TrainConfig, d: fsdp.Dist) -> RankBatches:
    """The epoch plans' micro-batches for this rank, read ahead by the prefetching loader."""
    dataset = OfflineDataset(job.hidden_uri)
    plans = plan_training(
        dataset.lengths,
        budget=cfg.batch_tokens,
        world=d.world,
        grad_accum=cfg.grad_accum,
        chunk_samples=cfg.chunk_samples,
        seed=job.seed,
        epochs=cfg.epochs,
    )
    flat = [(p.epoch, mb) for p in plans for step in p.for_rank(d.rank) for mb in step]

    def iterate(start: int) -> Generator[Step, None, None]:
        todo = flat[start * cfg.grad_accum :]
        loader = PrefetchLoader(
            dataset, [list(mb.indices) for _, mb in todo], workers=cfg.loader_workers, prefetch=cfg.prefetch
        )
        step: list[Micro] = []
        for (epoch, mb), samples in zip(todo, loader, strict=True):
            step.append(_micro(samples, mb, epoch, cfg, job.seed, d.device))
            if len(step) == cfg.grad_accum:
                yield epoch, step
                step = []

    return RankBatches(sum(p.num_steps for p in plans), len(dataset), iterate)


def online_batches(job, cfg: TrainConfig, d: fsdp.Dist) -> RankBatches:
    """Steps as the Mooncake stream delivers them (one rank: the stream has one consumer).

    Each window of arrivals is planned like an offline epoch, so a one-epoch window in store order trains
    exactly as the offline store does.
    """
    if not job.producer_module:
        raise ValueError("train job spec: an online run needs producer_module (the train stage writes it)")
    hidden_cfg = HiddenStatesConfig.model_validate(job.hidden_cfg)
    target = TargetConfig.model_validate(job.target)
    tokens = StageManifest.model_validate(job.tokens)
    lengths = [len(s["input_ids"]) for s in token_samples(tokens)]
    window = hidden_cfg.online.window_samples
    plan = functools.partial(
        plan_epoch, budget=cfg.batch_tokens, world=1, grad_accum=cfg.grad_accum, chunk_samples=cfg.chunk_samples,
        seed=job.seed,
    )  # fmt: skip

    def window_plan(window_lengths: list[int], k: int):
        return plan(window_lengths, epoch=k)

    per_epoch = data.count_stream_steps(lengths, window, window_plan)

    def iterate(start: int) -> Generator[Step, None, None]:
        # A resumed online run replays the stream and skips the steps the checkpoint already holds.
        source = OnlineSource(
            hidden_cfg, target, tokens, epochs=cfg.epochs, run_id=job.key[:12], producer_module=job.producer_module
        )
        with source as online:
            steps = data.stream_steps(online.samples(), window, window_plan)
            for i, (k, mbs, groups) in enumerate(steps):
                if i >= start:
                    yield k, [_micro(g, mb, k, cfg, job.seed, d.device) for mb, g in zip(mbs, groups, strict=True)]

    return RankBatches(per_epoch * cfg.epochs, len(lengths) * cfg.epochs, iterate)


def rank_batches(job, cfg: TrainConfig, d: fsdp.Dist) -> RankBatches:
    return offline_batches(job, cfg, d) if job.hidden_uri is not None else online_batches(job, cfg, d)


class Recorder:
    """Rank 0's view of the step records: adds epoch, throughput and MFU, and writes them to the sink. Other
    nodes' first ranks only mark their steps."""

    def __init__(self, cfg: TrainConfig, d: fsdp.Dist, sink: MetricsSink | None) -> None:
        self.cfg, self.d, self.sink = cfg, d, sink
        self.ended: dict[int, tuple[float, int]] = {}  # step -> (host time its step call returned, epoch)
        self.records: list[dict] = []
        self.flops_per_token: float | None = None
        self.peak: tuple[float, str] | None = None

    def step_done(self, step: int, epoch: int) -> None:
        self.ended[step] = (time.perf_counter(), epoch)
        # c10d may place rank 0 on another node: each node's first rank marks the steps for its own launcher's
        # training bar. Rank 0's sink logs the same step with its losses.
        if not self.d.is_main and self.d.local_rank == 0 and step % self.cfg.metrics.log_every == 0:
            log.info("train step %d | on rank %d of %d", step, self.d.rank, self.d.world)

    def write(self, raw: dict | None) -> None:
        if raw is None or self.sink is None:
            return
        step = raw["step"]
        end, epoch = self.ended[step]
        previous = self.ended.get(step - 1)
        for old in [k for k in self.ended if k < step - 1]:
            del self.ended[old]
        start = previous[0] if previous else None
        rec = {"step": step, "epoch": epoch} | {k: v for k, v in raw.items() if k not in ("step", "acc", "slot_loss")}
        rec |= {f"acc_{k}": a for k, a in enumerate(raw["acc"])}
        rec |= {f"slot_loss_{k}": x for k, x in enumerate(raw["slot_loss"])}
        rec["simulated_acc_len"] = simulated_acc_len(torch.tensor(raw["acc"]))
        if start is not None and end > start:
            rec["tokens_per_s"] = rec["tokens"] / (end - start)
            if self.flops_per_token and self.peak:
                achieved = self.flops_per_token * rec["tokens"] / (end - start)
                rec["mfu"] = achieved / (self.peak[0] * self.d.world)
        self.records.append(rec)
        self.sink.write(rec)


def measure_flops(built, first: Micro, cfg: TrainConfig, d: fsdp.Dist) -> tuple[float, tuple[float, str]]:
    """FLOPs per padded token (forward + backward, rank 0's unsharded copy, one sample of the first batch)
    and this device's peak, for MFU."""
    batch = {k: v[:1, :512].cpu() for k, v in first.batch.items()}
    per_step = flops.flops_per_step(lambda: built.full(batch)[0])
    built.full.zero_grad(set_to_none=True)
    dtype = fsdp.DTYPES[cfg.mixed_precision.param_dtype]
    return per_step / batch["input_ids"].numel(), flops.device_peak_flops(
        d.device, dtype, override=cfg.metrics.peak_flops
    )


def _local_metrics_path(job, d: fsdp.Dist) -> Path:
    """metrics.jsonl is appended line by line: in the stage folder when local, else a local copy uploaded."""
    if storage.is_local(job.out_uri):
        return storage.local_path(storage.join(job.out_uri, "metrics.jsonl"))
    path = Path(tempfile.gettempdir()) / "draftsmith-train" / job.key[:16] / "metrics.jsonl"
    remote = storage.join(job.out_uri, "metrics.jsonl")
    if d.is_main and storage.exists(remote):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(storage.read_bytes(remote))
    return path


def train(job, cfg: TrainConfig, d: fsdp.Dist, built, trainer: Trainer, batches: RankBatches, start: int) -> None:
    """Steps from `start` to the end (or `job.max_steps`), checkpointing every `checkpoint.every_steps`."""
    metrics_path = _local_metrics_path(job, d)
    sink = None
    if d.is_main:
        tb = storage.local_path(storage.join(job.out_uri, "tensorboard")) if cfg.metrics.tensorboard else None
        sink = MetricsSink(metrics_path, tensorboard_dir=tb, log_every=cfg.metrics.log_every, logger=log)
        sink.truncate_after(start)
    rec = Recorder(cfg, d, sink)
    stop = min(batches.total_steps, job.max_steps or batches.total_steps)
    # closing: stopping early (max_steps) must also stop the loader's read-ahead threads before export.
    with contextlib.closing(batches.iterate(start)) as steps:
        loop = Loop(job, cfg, d, built, trainer, rec, metrics_path)
        trained = loop.run(itertools.islice(steps, max(0, stop - start)), stop)
    rec.write(trainer.flush())
    log.info("train: rank %d trained %d micro-batches in steps %d..%d", d.rank, trained, start + 1, trainer.step)
    if sink is not None:
        sink.close()
    trainer.check_finished()  # before export: a diverged drafter must not look trained
    export(job, d, built, rec, batches, metrics_path)


@dataclass
class Loop:
    """The step loop of one rank, with its checkpoints and the fault-injection hook."""

    job: Any  # the worker's TrainJob (`draftsmith.drafters.training.worker`, which imports this module)
    cfg: TrainConfig
    d: fsdp.Dist
    built: Any
    trainer: Trainer
    rec: Recorder
    metrics_path: Path

    def run(self, steps: Iterator[Step], stop: int) -> int:
        """Train `steps`; returns how many micro-batches this rank trained."""
        ckpts = Checkpoints(self.job.checkpoint_uri, self.cfg.checkpoint.keep, self.d)
        every, fault = self.cfg.checkpoint.every_steps, int(os.environ.get(FAULT_ENV, 0))
        trainer, rec, trained = self.trainer, self.rec, 0
        rec.ended[trainer.step] = (time.perf_counter(), 0)
        try:
            for epoch, micros in steps:
                trained += len(micros)
                if self.d.is_main and rec.flops_per_token is None:
                    rec.flops_per_token, rec.peak = measure_flops(self.built, micros[0], self.cfg, self.d)
                    rec.ended[trainer.step] = (time.perf_counter(), epoch)
                rec.write(trainer.train_step(micros))
                rec.step_done(trainer.step, epoch)
                if every and trainer.step % every == 0 and trainer.step < stop:
                    rec.write(trainer.flush())
                    ckpts.save(trainer)
                    self._upload_metrics()
                if fault and trainer.step == fault and self.d.is_main:
                    os.killpg(os.getpgrp(), signal.SIGKILL)  # the whole job, as a lost node would: see FAULT_ENV
        except StreamError as e:
            # The stream's own words say what was lost; what survives is the trainer's to say. One error,
            # not a chain: the stream layer's traceback adds nothing to its message.
            raise type(e)(f"{e}\n{self._what_survives(ckpts)}") from None
        return trained

    def _what_survives(self, ckpts: Checkpoints) -> str:
        done = ckpts.complete()
        if not done:
            return f"training stopped at step {self.trainer.step}, before its first checkpoint: a rerun starts over"
        step, url = done[-1]
        return (
            f"training stopped at step {self.trainer.step}; checkpoint {url} (step {step}) is complete and untouched, "
            "and a rerun resumes from it (the stream is replayed, the steps it holds skipped)"
        )

    def _upload_metrics(self) -> None:
        if self.d.is_main and not storage.is_local(self.job.out_uri):
            storage.write_bytes(storage.join(self.job.out_uri, "metrics.jsonl"), self.metrics_path.read_bytes())


def final_metrics(records: list[dict], last: int = 10) -> dict[str, float]:
    """Means over the last `last` steps (end-of-training loss and accuracies), run-wide throughput and MFU."""
    tail = [r for r in records if not r["skipped"]][-last:] or records[-last:]
    out = {"loss": sum(r["loss"] for r in tail) / len(tail)}
    slots = sum(1 for k in tail[0] if k.startswith("acc_"))
    acc = [sum(r[f"acc_{k}"] for r in tail) / len(tail) for k in range(slots)]
    out |= {f"acc_{k}": a for k, a in enumerate(acc)}
    out["simulated_acc_len"] = simulated_acc_len(torch.tensor(acc))
    timed = [r for r in records if "tokens_per_s" in r]
    if timed:
        seconds = sum(r["tokens"] / r["tokens_per_s"] for r in timed)
        out["tokens_per_s"] = sum(r["tokens"] for r in timed) / seconds
    if any("mfu" in r for r in timed):
        out["mfu"] = sum(r["mfu"] * r["tokens"] / r["tokens_per_s"] for r in timed) / seconds
    return {k: round(v, 5) for k, v in out.items()}


def export(job, d: fsdp.Dist, built, rec: Recorder, batches: RankBatches, metrics_path: Path) -> None:
    """Consolidate the shards (collective) and, on rank 0, write the serving checkpoint and `result.json`."""
    state = fsdp.consolidated(built.module)
    if not d.is_main:
        return
    drafter_cfg = parse_drafter(job.drafter)
    target = TargetConfig.model_validate(job.target)
    built.full.drafter.load_state_dict(state)
    config = built.full_config
    meta = {
        "target": target.name,
        "train_key": job.key,
        "tap_convention": "residual after layer k, from 1",
        "num_target_layers": target.num_layers,
        "max_position_embeddings": int(getattr(config, "max_position_embeddings", 0) or 0) or None,
    }
    taps = HiddenStatesConfig.model_validate(job.hidden_cfg).taps
    blobs = families.family(drafter_cfg.kind).checkpoint_blobs(built.full.drafter, taps, meta)
    blobs["metrics.jsonl"] = metrics_path.read_bytes()
    files = [file_entry(job.out_uri, name, blob).model_dump() for name, blob in blobs.items()]
    records = rec.records
    last = records[-1] if records else {}
    result = {
        "files": files,
        "counts": {
            "steps": last.get("step", 0),
            "samples": batches.num_samples,
            "padded_tokens": sum(r["tokens"] for r in records),
            "skipped_steps": last.get("skipped_steps", 0),
            "world_size": d.world,
        },
        "metrics": final_metrics(records) if records else {},
        "info": {"drafter": drafter_cfg.kind, "hidden_states": "offline" if job.hidden_uri else "online"},
        "summary_markdown": summary_markdown(records, title=f"{target.name} {drafter_cfg.kind} training"),
    }
    storage.write_json(storage.join(job.out_uri, "result.json"), result)
