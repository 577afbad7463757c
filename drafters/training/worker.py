"""The torchrun entry point: `python -m draftsmith.drafters.training.worker --spec JOB.json`, one process per rank.

The `train` task writes the job spec, launches torchrun (`drafters.training.torchrun`) and reads back `result.json`,
which rank 0 writes after the consolidated export. Every rank builds the same plan from the sample lengths,
shards the drafter, resumes from the newest complete checkpoint and trains its own micro-batches. Each rank
beats a heartbeat for the launcher (`rank_health.start_heartbeat`), bounded by `train.distributed.timeout_s`.
"""

import argparse
import gc
import json
import logging
import os
import sys
import traceback
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from draftsmith import kernels
from draftsmith.core import procs, storage, tensorio
from draftsmith.core.config import HiddenStatesConfig, TargetConfig
from draftsmith.core.config.drafter import parse_drafter
from draftsmith.core.config.train import TrainConfig
from draftsmith.drafters import families
from draftsmith.drafters.training import fsdp, rank_health, run
from draftsmith.drafters.training.checkpoint import Checkpoints
from draftsmith.drafters.training.loop import Trainer
from draftsmith.drafters.training.target_parts import load_target_parts, target_head

log = logging.getLogger("draftsmith.drafters.training")


@dataclass
class TrainJob:
    """Everything the ranks need, as JSON (`python -m draftsmith.drafters.training.worker --spec FILE`)."""

    train: dict
    drafter: dict
    target: dict
    hidden_cfg: dict
    out_uri: str  # the stage folder: checkpoint files, metrics.jsonl, result.json
    checkpoint_uri: str
    counts_uri: str  # safetensors `{"counts": [V]}`: how often each id is a loss token (draft vocabulary)
    key: str
    seed: int
    hidden_uri: str | None = None  # the offline store; None: online through Mooncake
    tokens: dict | None = None  # the tokenize manifest (online producers need it)
    max_steps: int | None = None  # stop early (benchmarks); the schedule still spans the whole run
    producer_module: str | None = None  # what an online run's local producers run (`python -m MODULE`)

    def write(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(asdict(self), f)

    @classmethod
    def read(cls, path: str) -> "TrainJob":
        with open(path) as f:
            return cls(**json.load(f))


@dataclass
class Built:
    """The sharded module, rank 0's real copy (for FLOPs and export) and the objective's generator."""

    module: fsdp.TrainModule
    full: fsdp.TrainModule | None
    generator: torch.Generator
    head: torch.Tensor
    full_config: object  # the target's HF config


def build(job: TrainJob, d: fsdp.Dist) -> Built:
    """Meta layout everywhere, real weights on rank 0 only, shards filled by broadcast."""
    cfg = TrainConfig.model_validate(job.train)
    kernels.set_mode(cfg.kernels)
    drafter_cfg = parse_drafter(job.drafter)
    target = TargetConfig.model_validate(job.target)
    family = families.family(drafter_cfg.kind)
    num_taps = len(HiddenStatesConfig.model_validate(job.hidden_cfg).taps)
    parts = load_target_parts(target, materialize=True, modules=drafter_cfg.target_modules(target.num_layers))
    head = target_head(parts)
    full = None
    if d.is_main:
        counts = tensorio.loads(storage.read_bytes(job.counts_uri))[0]["counts"]
        torch.manual_seed(job.seed)  # the initial weights depend on the seed only, never on the world size
        full = fsdp.TrainModule(family.build(drafter_cfg, families.BuildInputs(target, parts, num_taps, counts)), None)
    del parts
    skeleton = load_target_parts(target, materialize=False)
    with torch.device("meta"):
        counts_meta = torch.zeros(target.vocab_size, dtype=torch.long)
        meta = family.build(drafter_cfg, families.BuildInputs(target, skeleton, num_taps, counts_meta))
    module = fsdp.shard(fsdp.TrainModule(meta, None), cfg.mixed_precision, compile_layers=cfg.compile)
    fsdp.materialize(module, full, d)
    dtype = fsdp.DTYPES[cfg.mixed_precision.param_dtype]
    generator = torch.Generator(device="cpu")
    head = head.to(d.device, dtype)
    module.objective = family.objective(drafter_cfg, module.drafter, head, generator)
    if full is not None:
        full.objective = family.objective(drafter_cfg, full.drafter, head.float().cpu(), torch.Generator())
    return Built(module, full, generator, head, skeleton.config)


@record
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--spec", required=True, help="The TrainJob JSON the train task wrote.")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    job = TrainJob.read(args.spec)
    cfg = TrainConfig.model_validate(job.train)
    # A rank stopped for as long as a peer's collective would wait for it is named and killed by the launcher.
    rank_health.start_heartbeat(cfg.distributed.timeout_s, "train.distributed.timeout_s")
    torch.set_num_threads(int(os.environ.get("DRAFTSMITH_THREADS", cfg.rank_threads())))
    d = fsdp.init_distributed(cfg.distributed)
    try:
        built = build(job, d)
        batches = run.rank_batches(job, cfg, d)
        trainer = Trainer(built.module, cfg, d, batches.total_steps, built.generator)
        start = Checkpoints(job.checkpoint_uri, cfg.checkpoint.keep, d).resume(trainer)
        if d.local_rank == 0:  # each node's first rank: rank 0 may run on another node than the launching one
            log.info("train: rank %d of %d, %d steps, resuming at step %d", d.rank, d.world, batches.total_steps, start)
        run.train(job, cfg, d, built, trainer, batches, start)
        dist.barrier()  # every rank is past its last collective before any rank tears the group down
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    del built, trainer, batches
    gc.collect()
    _exit_without_finalizing()


def _exit_without_finalizing(code: int = 0) -> None:
    """Leave the rank with `os._exit(code)`: everything it wrote is closed and renamed into place by now.

    A gloo worker thread can still drop its last tensors while CPython finalizes. Those tensors hold
    Python references, the thread takes the GIL, CPython ends the thread with a forced unwind, and a
    noexcept C++ frame turns that into "terminate called without an active exception" (SIGABRT). The CI
    saw it once in a 2-rank run, after every step and the export had succeeded. torch has no fix yet
    (pytorch#179291 was abandoned). Skipping finalization skips the race, and a finished rank has no
    atexit work left. A failed rank has none either once `@record` has written its error file; there,
    finalizing would also close a Mooncake client whose master died, which retries for ~11 s.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    # torchrun starts ranks in their own sessions and cannot stop them when it is SIGKILLed itself.
    procs.die_with_parent()
    try:
        main()
    except Exception:
        traceback.print_exc()  # what the interpreter would print on its way out
        _exit_without_finalizing(1)
