"""Training samples read from hidden-state shards, and length-grouped padded batches.

Shape legend: S sequence, F = N*Ht fused taps, Ht target width, B batch.
"""

import json
from dataclasses import dataclass

import torch

from draftsmith import storage, tensorio
from draftsmith.batching import group_by_length
from draftsmith.manifest import StageManifest


@dataclass
class TrainSample:
    """`input_ids` `[S]` int64, `loss_mask` `[S]` bool, `features` `[S, F]`, `last_hidden` `[S, Ht]`."""

    id: str
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    features: torch.Tensor
    last_hidden: torch.Tensor
    in_draft: torch.Tensor | None = None  # [S] bool: the target's argmax at each position is draftable


def load_hidden_shards(manifest: StageManifest) -> list[TrainSample]:
    """Every sample of the hidden-state stage, in shard order."""
    samples = []
    for name in manifest.names("hidden-"):
        tensors, meta = tensorio.loads(storage.read_bytes(manifest.path(name)))
        ids = json.loads(meta["ids"])
        off = tensors["offsets"].tolist()
        for i, sid in enumerate(ids):
            sl = slice(off[i], off[i + 1])
            samples.append(
                TrainSample(
                    id=sid,
                    input_ids=tensors["input_ids"][sl].long(),
                    loss_mask=tensors["loss_mask"][sl].bool(),
                    features=tensors["hidden_states"][sl],
                    last_hidden=tensors["last_hidden"][sl],
                )
            )
    return samples


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
