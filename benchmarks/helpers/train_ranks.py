"""Parts 3 and 4 of `benchmarks.train`: the real `train` stage through torchrun on 1 rank and on 2 ranks.

Both runs read the same synthetic offline store (written with `draftsmith.transport.offline_store` at the target's
shapes) and train the same micro-batches per optimizer step: 1 rank x grad_accum 2 against 2 ranks x
grad_accum 1, with the machine's cores split between the ranks. `tokens_per_s` and `mfu` come from the
manifests' metrics. The per-rank peak handed to the runs (`train.metrics.peak_flops`) is the machine's
measured fp32 matmul peak divided by the rank count, so the manifest's MFU is achieved FLOP/s over the whole
machine's peak in both runs.
"""

import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.helpers.train_data import SampleMaker, lognormal_lengths, write_hidden_store, write_tokens
from draftsmith.drafters import families
from draftsmith.drafters.training.plan import plan_epoch
from draftsmith.drafters.training.target_parts import load_target_parts
from draftsmith.tasks.train import train


@dataclass(frozen=True)
class RankRun:
    ranks: int
    grad_accum: int
    threads: int
    steps: int
    padded_tokens: int
    tokens_per_s: float
    mfu: float
    seconds: float  # wall time of the whole stage (torchrun start-up, FLOP count and export included)


def lengths_for_steps(recipe, steps: int, *, max_len: int, seed: int = 0) -> list[int]:
    """The fewest log-normal lengths whose one-epoch plan (2 micro-batches a step) has `steps` steps.

    The runs then end with their epoch rather than at `max_steps`: stopping mid-epoch leaves the loader's
    read-ahead in flight at shutdown, and a gloo rank has been seen to abort there (see the report).
    """
    cfg = recipe.train
    pool = lognormal_lengths(64 * steps, median=max_len / 3, sigma=0.8, lo=16, hi=max_len, seed=seed)

    def planned(n: int) -> int:
        return plan_epoch(pool[:n], budget=cfg.batch_tokens, world=1, grad_accum=2, chunk_samples=cfg.chunk_samples,
                          seed=recipe.seed, epoch=0).num_steps  # fmt: skip

    lo, hi = 1, len(pool)
    if planned(hi) < steps:
        raise ValueError(f"benchmarks.train: {hi} samples plan fewer than {steps} steps")
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if planned(mid) < steps else (lo, mid)
    return pool[:lo]


def write_inputs(recipe, folder: str, *, steps: int, max_len: int, seed: int = 0):
    """The synthetic tokenize manifest and hidden-state store both runs read: one epoch of `steps` steps."""
    parts = load_target_parts(recipe.target, materialize=True)
    embed = families.weight_of(parts.get_input_embeddings())
    maker = SampleMaker(embed.detach(), len(recipe.hidden_states.taps), seed)
    del parts
    lengths = lengths_for_steps(recipe, steps, max_len=max_len, seed=seed)
    items = list(maker.samples(lengths))
    tokens = write_tokens(str(Path(folder, "tokenize")), items)
    hidden = write_hidden_store(str(Path(folder, "hidden_states")), items, recipe.hidden_states, recipe.target)
    return tokens, hidden


def train_on_ranks(recipe, tokens, hidden, out: str, *, ranks: int, cpus: int, peak: float) -> RankRun:
    """One `tasks.train.train` run on `ranks` ranks with the global batch of `ranks * grad_accum` = 2 micro-batches."""
    if 2 % ranks:
        raise ValueError(f"benchmarks.train: ranks must divide the 2 micro-batches of a step, got {ranks}")
    base = recipe.train
    cfg = base.model_copy(
        update={
            "grad_accum": 2 // ranks,
            "epochs": 1,
            "threads": max(1, cpus // ranks),
            "distributed": base.distributed.model_copy(update={"nproc_per_node": ranks}),
            "resources": base.resources.model_copy(update={"cpus": cpus}),
            "checkpoint": base.checkpoint.model_copy(update={"every_steps": 0}),
            "metrics": base.metrics.model_copy(update={"peak_flops": peak / ranks, "log_every": 10_000}),
        }
    )
    start = time.perf_counter()
    m = train(cfg, recipe.drafter, recipe.target, recipe.hidden_states, tokens, hidden,
              seed=recipe.seed, out_uri=out)  # fmt: skip
    seconds = time.perf_counter() - start
    for key in ("tokens_per_s", "mfu"):
        if key not in m.metrics:
            raise RuntimeError(f"benchmarks.train: the {ranks}-rank manifest at {m.uri} has no metrics.{key}")
    return RankRun(ranks, cfg.grad_accum, cfg.threads, m.counts["steps"], m.counts["padded_tokens"],
                   m.metrics["tokens_per_s"], m.metrics["mfu"], seconds)  # fmt: skip


def run_rank_bench(recipe, *, max_len: int, steps: int, peak: float, cpus: int = 2) -> list[RankRun]:
    """The 1-rank run, then the 2-rank run, on one synthetic store (deleted afterwards)."""
    # The stage logs every rank's lines at INFO; the benchmark prints its own table.
    logging.getLogger("draftsmith.train").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="bench-train-ranks-") as folder:
        tokens, hidden = write_inputs(recipe, folder, steps=steps, max_len=max_len)
        return [
            train_on_ranks(
                recipe, tokens, hidden, str(Path(folder, f"train-{n}")), ranks=n, cpus=cpus, peak=peak
            )  # fmt: skip
            for n in (1, 2)
        ]
