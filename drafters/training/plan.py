"""Length-grouped, rank-balanced epoch plans for the data-parallel trainer.

An epoch plan is computed identically on every rank from the sample lengths alone, so ranks agree on
every step without exchanging anything, and a resumed run rebuilds the same plan from (seed, epoch).

Pipeline for one epoch:
1. a permutation seeded from (seed, epoch);
2. chunks of `chunk_samples` consecutive shuffled samples, each sorted longest first;
3. greedy token-budget micro-batches inside each chunk (`B * max_len <= budget`; an over-long sample
   forms a micro-batch alone);
4. consecutive `world * grad_accum` micro-batches form one optimizer step; full steps are shuffled so long
   and short steps interleave, and the trailing partial step stays last, topped up with filler micro-batches;
5. within a step, micro-batches are bin-packed across ranks (LPT on padded tokens), `grad_accum` per rank.

Steps 1-4 depend on `world * grad_accum` only, never on `world` alone: 1 rank x 2 micro-batches and
2 ranks x 1 micro-batch see the same micro-batches in every step.
"""

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from draftsmith.core.batching import group_by_length


@dataclass(frozen=True)
class MicroBatch:
    """One forward/backward on one rank: `len(indices)` samples right-padded to the longest."""

    indices: tuple[int, ...]  # dataset sample indices, longest first
    padded_tokens: int  # len(indices) * max length
    real_tokens: int  # sum of lengths
    padding: bool = False  # a filler micro-batch: its samples train with an all-zero loss mask


@dataclass(frozen=True)
class EpochPlan:
    """All optimizer steps of one epoch: `steps[step][rank]` is that rank's `grad_accum` micro-batches."""

    epoch: int
    steps: tuple[tuple[tuple[MicroBatch, ...], ...], ...]

    def for_rank(self, rank: int) -> list[tuple[MicroBatch, ...]]:
        """That rank's micro-batches, one tuple per step (every tuple has `grad_accum` entries)."""
        world = len(self.steps[0]) if self.steps else 0
        if not 0 <= rank < world:
            raise ValueError(f"rank must be in [0, {world}), got {rank}")
        return [step[rank] for step in self.steps]

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    @cached_property
    def micro_batches(self) -> tuple[MicroBatch, ...]:
        """Every micro-batch of the epoch, fillers included, step by step and rank by rank."""
        return tuple(mb for step in self.steps for rank in step for mb in rank)

    @property
    def padded_tokens(self) -> int:
        """Padded tokens of the real (non-filler) micro-batches."""
        return sum(mb.padded_tokens for mb in self.micro_batches if not mb.padding)

    @property
    def real_tokens(self) -> int:
        """Real tokens of the real (non-filler) micro-batches."""
        return sum(mb.real_tokens for mb in self.micro_batches if not mb.padding)

    @property
    def padding_share(self) -> float:
        """Share of padded tokens that are padding, over the real (non-filler) micro-batches."""
        return padding_share(self.micro_batches)


def padding_share(batches: Iterable[MicroBatch]) -> float:
    """`1 - real / padded` over the non-filler micro-batches (0.0 when there are none)."""
    padded = real = 0
    for mb in batches:
        if not mb.padding:
            padded += mb.padded_tokens
            real += mb.real_tokens
    return 1.0 - real / padded if padded else 0.0


def plan_epoch(
    lengths: Sequence[int],
    *,
    budget: int,
    world: int,
    grad_accum: int,
    chunk_samples: int,
    seed: int,
    epoch: int,
) -> EpochPlan:
    """The deterministic plan of one epoch (see the module docstring for the algorithm)."""
    lengths = _validate(lengths, budget=budget, world=world, grad_accum=grad_accum, chunk_samples=chunk_samples)
    if epoch < 0:
        raise ValueError(f"epoch must be >= 0, got {epoch}")
    gen = _generator(seed, epoch)
    order = torch.randperm(len(lengths), generator=gen).tolist()
    micro = _chunked_micro_batches(lengths, order, budget, chunk_samples)
    group = world * grad_accum
    full = [micro[i : i + group] for i in range(0, len(micro) - group + 1, group)]
    # The shuffle consumes the same generator stream for any world with the same world * grad_accum.
    full = [full[p] for p in torch.randperm(len(full), generator=gen).tolist()]
    tail = micro[len(full) * group :]
    if tail:
        shortest = min(range(len(lengths)), key=lambda i: (lengths[i], i))
        filler = _micro_batch((shortest,), lengths, padding=True)
        full.append(tail + [filler] * (group - len(tail)))
    steps = tuple(_balance(step, world, grad_accum) for step in full)
    return EpochPlan(epoch=epoch, steps=steps)


def plan_training(
    lengths: Sequence[int],
    *,
    budget: int,
    world: int,
    grad_accum: int,
    chunk_samples: int,
    seed: int,
    epochs: int,
) -> list[EpochPlan]:
    """One plan per epoch, epochs `0 .. epochs-1`; each epoch is reshuffled from (seed, epoch)."""
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    return [
        plan_epoch(
            lengths,
            budget=budget,
            world=world,
            grad_accum=grad_accum,
            chunk_samples=chunk_samples,
            seed=seed,
            epoch=e,
        )
        for e in range(epochs)
    ]


def random_batches(lengths: Sequence[int], *, budget: int, seed: int) -> list[MicroBatch]:
    """Baseline without length grouping: shuffled order, greedy fill while `B * max_len <= budget`."""
    lengths = _validate(lengths, budget=budget, world=1, grad_accum=1, chunk_samples=1)
    order = torch.randperm(len(lengths), generator=_generator(seed, 0)).tolist()
    groups: list[list[int]] = []
    longest = 0
    for i in order:
        grown = max(longest, lengths[i])
        if groups and (len(groups[-1]) + 1) * grown <= budget:
            groups[-1].append(i)
            longest = grown
        else:
            groups.append([i])
            longest = lengths[i]
    return [_micro_batch(sorted(g, key=lambda i: -lengths[i]), lengths) for g in groups]


def _validate(lengths: Sequence[int], *, budget: int, world: int, grad_accum: int, chunk_samples: int) -> list[int]:
    if len(lengths) == 0:
        raise ValueError("lengths must not be empty")
    for name, value in (("budget", budget), ("world", world), ("grad_accum", grad_accum)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if chunk_samples < 1:
        raise ValueError(f"chunk_samples must be >= 1, got {chunk_samples}")
    out = [int(n) for n in lengths]
    for i, n in enumerate(out):
        if n < 1:
            raise ValueError(f"lengths[{i}] must be >= 1 token, got {n}")
    return out


def _generator(seed: int, epoch: int) -> torch.Generator:
    # A hash rather than seed + epoch, so (seed, epoch + 1) never replays (seed + 1, epoch).
    digest = hashlib.sha256(f"draftsmith-plan:{seed}:{epoch}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def _micro_batch(indices: Sequence[int], lengths: list[int], *, padding: bool = False) -> MicroBatch:
    lens = [lengths[i] for i in indices]
    return MicroBatch(
        indices=tuple(indices), padded_tokens=len(lens) * max(lens), real_tokens=sum(lens), padding=padding
    )


def _chunked_micro_batches(lengths: list[int], order: list[int], budget: int, chunk: int) -> list[MicroBatch]:
    """Budget micro-batches of each chunk of `order`, chunk by chunk, longest first inside a chunk."""
    out: list[MicroBatch] = []
    for start in range(0, len(order), chunk):
        part = order[start : start + chunk]
        # group_by_length breaks ties by position, i.e. by shuffled order, so ties are seeded too.
        for group in group_by_length([lengths[i] for i in part], budget):
            out.append(_micro_batch([part[j] for j in group], lengths))
    return out


def _balance(step: list[MicroBatch], world: int, grad_accum: int) -> tuple[tuple[MicroBatch, ...], ...]:
    """LPT bin-packing of `world * grad_accum` micro-batches onto ranks, exactly `grad_accum` each.

    Heaviest first (cost = padded tokens, ties by position), each to the least-loaded rank that still has
    room (ties to the lowest rank). Each rank's micro-batches keep heaviest-first order.
    """
    load = [0] * world
    assigned: list[list[MicroBatch]] = [[] for _ in range(world)]
    for pos in sorted(range(len(step)), key=lambda p: (-step[p].padded_tokens, p)):
        rank = min((r for r in range(world) if len(assigned[r]) < grad_accum), key=lambda r: (load[r], r))
        assigned[rank].append(step[pos])
        load[rank] += step[pos].padded_tokens
    return tuple(tuple(a) for a in assigned)
