"""Training samples from the hidden-state store or stream, and length-grouped padded batches.

Shape legend: S sequence, F = N*Ht fused taps, Ht target width, B batch.
"""

from collections.abc import Callable, Iterable, Iterator

import torch

from draftsmith.core.manifest import StageManifest
from draftsmith.drafters.training.plan import EpochPlan, MicroBatch
from draftsmith.transport.offline_reader import OfflineDataset
from draftsmith.transport.sample import HiddenSample

# The trainer reads the samples the store or the stream decode; one type, so their sources stay interchangeable.
TrainSample = HiddenSample


def hidden_dataset(hidden: StageManifest) -> OfflineDataset:
    """The offline store the hidden-state stage wrote (ranged/mmap reads; see `draftsmith.transport.offline_reader`)."""
    return OfflineDataset(hidden.uri)


def collate(
    samples: list[TrainSample], *, zero_mask: bool = False, min_loss_tokens: int = 1, prompt_loss: bool = False
) -> dict[str, torch.Tensor]:
    """Right-padded fp32 batch: ids/masks `[B, S]`, features `[B, S, F]`, last hidden `[B, S, Ht]`.

    A sample with fewer than `min_loss_tokens` loss tokens, or every sample when `zero_mask` (a filler
    micro-batch), keeps its place with an all-zero loss mask: it runs forward and backward like the others,
    so data-parallel ranks stay in step, but teaches nothing. With `prompt_loss`, a counted sample's every
    token after the first is a loss token (its prompt too; `TrainConfig.prompt_loss`).
    """
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
        if not zero_mask and int(s.loss_mask.sum()) >= min_loss_tokens:
            out["loss_mask"][row, :n] = s.loss_mask
            if prompt_loss:
                out["loss_mask"][row, 1:n] = True
        out["features"][row, :n] = s.features.float()
        out["last_hidden"][row, :n] = s.last_hidden.float()
        if s.in_draft is not None:
            out["in_draft"][row, :n] = s.in_draft
    return out


def stream_steps(
    samples: Iterable[TrainSample], window: int, plan: Callable[[list[int], int], EpochPlan]
) -> Iterator[tuple[int, tuple[MicroBatch, ...], list[list[TrainSample]]]]:
    """Optimizer steps from a stream: every `window` arrivals are planned like an epoch of the offline store.

    `plan(lengths, k)` plans window `k` (`draftsmith.drafters.training.plan.plan_epoch` with epoch `k`); yields
    `(k, micro-batches, their samples)` per step. Memory stays at one window of samples; the plan depends only
    on the lengths, so `count_stream_steps` knows the step count before the first sample arrives, and a
    window holding a whole epoch in store order is planned exactly as the offline store's epoch is.
    """

    def planned(buf: list[TrainSample], k: int) -> Iterator[tuple[int, tuple[MicroBatch, ...], list[list]]]:
        for step in plan([len(x.input_ids) for x in buf], k).for_rank(0):
            yield k, step, [[buf[i] for i in mb.indices] for mb in step]

    buf: list[TrainSample] = []
    k = 0
    for s in samples:
        buf.append(s)
        if len(buf) == window:
            yield from planned(buf, k)
            buf, k = [], k + 1
    if buf:
        yield from planned(buf, k)


def count_stream_steps(lengths: list[int], window: int, plan: Callable[[list[int], int], EpochPlan]) -> int:
    """How many steps `stream_steps` makes of samples arriving with these lengths, in this order."""
    return sum(plan(lengths[i : i + window], i // window).num_steps for i in range(0, len(lengths), window))
