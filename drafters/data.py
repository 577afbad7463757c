"""Training samples from the hidden-state store or stream, and length-grouped padded batches.

Shape legend: S sequence, F = N*Ht fused taps, Ht target width, B batch.
"""

from collections.abc import Iterable, Iterator

import torch

from draftsmith.batching import group_by_length
from draftsmith.manifest import StageManifest
from transport.offline_reader import OfflineDataset
from transport.sample import HiddenSample

# The trainer reads the samples the store or the stream decode; one type, so their sources stay interchangeable.
TrainSample = HiddenSample


def hidden_dataset(hidden: StageManifest) -> OfflineDataset:
    """The offline store the hidden-state stage wrote (ranged/mmap reads; see `transport.offline_reader`)."""
    return OfflineDataset(hidden.uri)


def length_grouped_batches(lengths: list[int], budget: int, *, seed: int) -> list[list[int]]:
    """Batches of similar length with `batch * max_len <= budget`, in a seeded random order.

    Sorting by length keeps padding low; shuffling the batch order keeps the optimiser from seeing
    all short (or all long) samples in a row.
    """
    batches = group_by_length(lengths, budget)
    perm = torch.randperm(len(batches), generator=torch.Generator().manual_seed(seed)).tolist()
    return [batches[p] for p in perm]


def collate(samples: list[TrainSample]) -> dict[str, torch.Tensor]:
    """Right-padded fp32 batch: ids/masks `[B, S]`, features `[B, S, F]`, last hidden `[B, S, Ht]`."""
    width = max(len(s.input_ids) for s in samples)
    B = len(samples)
    out = {
        "input_ids": torch.zeros(B, width, dtype=torch.long),
        "loss_mask": torch.zeros(B, width, dtype=torch.bool),
        "in_draft": torch.zeros(B, width, dtype=torch.bool),
        "features": torch.zeros(B, width, samples[0].features.shape[-1]),
        "last_hidden": torch.zeros(B, width, samples[0].last_hidden.shape[-1]),
    }
    for row, s in enumerate(samples):
        n = len(s.input_ids)
        out["input_ids"][row, :n] = s.input_ids
        out["loss_mask"][row, :n] = s.loss_mask
        out["features"][row, :n] = s.features.float()
        out["last_hidden"][row, :n] = s.last_hidden.float()
        if s.in_draft is not None:
            out["in_draft"][row, :n] = s.in_draft
    return out


def stream_batches(
    samples: Iterable[TrainSample], budget: int, window: int, *, seed: int
) -> Iterator[list[TrainSample]]:
    """Length-grouped batches from a stream: every `window` arrivals are grouped like `length_grouped_batches`.

    Memory stays at one window of samples; the grouping and its seeded order depend only on the lengths,
    so `count_stream_batches` knows the step count before the first sample arrives.
    """

    def grouped(buf: list[TrainSample], k: int) -> Iterator[list[TrainSample]]:
        for b in length_grouped_batches([len(x.input_ids) for x in buf], budget, seed=seed + k):
            yield [buf[i] for i in b]

    buf: list[TrainSample] = []
    k = 0
    for s in samples:
        buf.append(s)
        if len(buf) == window:
            yield from grouped(buf, k)
            buf, k = [], k + 1
    if buf:
        yield from grouped(buf, k)


def count_stream_batches(lengths: list[int], budget: int, window: int) -> int:
    """How many batches `stream_batches` makes of samples arriving with these lengths, in this order."""
    return sum(len(group_by_length(lengths[i : i + window], budget)) for i in range(0, len(lengths), window))
