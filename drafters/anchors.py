"""Anchor sampling for anchored EAGLE-3 TTT and for DFlash/DSpark blocks: a fixed number of slots per row.

Slots are fixed (`N` per row, with a keep mask) so that masks and shapes never change between steps
(no flex-attention recompiles); a row with fewer candidates keeps fewer slots. Dropped slots hold anchor 0.

Shape legend: B batch, S sequence, N slots.
"""

import torch


def candidates(loss_mask_S: torch.Tensor, depth: int) -> torch.Tensor:
    """Positions a with `mask[a] = mask[a+1] = 1` and `a <= S - depth`, ascending (a chain of `depth`
    steps from a must stay inside the sequence and start on supervised ground)."""
    m = loss_mask_S.bool()
    ok = torch.zeros_like(m)
    ok[:-1] = m[:-1] & m[1:]
    ok[max(0, len(m) - depth + 1) :] = False
    return ok.nonzero().flatten()


def strided_anchors(
    loss_mask_BS: torch.Tensor, num: int, depth: int, max_gap: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchored EAGLE-3 (TorchSpec's `ops/anchors.py` rule): `anchors` `[B, N]` sorted, `keep` `[B, N]`.

    Over a row's ordered candidates, take every `stride`-th from a random phase, wrapping around, with
    `stride = clamp(count // num, 1, max_gap + 1)`. When `count // num` is within the cap, every candidate is
    picked with probability `num / count` and consecutive anchors are at most `max_gap + 1` candidates apart,
    so each token is supervised at about one depth; `max_gap = 0` makes anchors contiguous, and with
    `num >= count` every candidate is an anchor (the dense-TTT case).
    """
    if num < 1 or max_gap < 0:
        raise ValueError(f"anchors: need num >= 1 and max_gap >= 0, got num={num}, max_gap={max_gap}")
    B = loss_mask_BS.shape[0]
    anchors = torch.zeros(B, num, dtype=torch.long)
    keep = torch.zeros(B, num, dtype=torch.bool)
    for b in range(B):
        cand = candidates(loss_mask_BS[b], depth)
        count = len(cand)
        if count == 0:
            continue
        if count <= num:
            picked = cand
        else:
            stride = min(max(count // num, 1), max_gap + 1)
            phase = int(torch.randint(count, (1,), generator=generator))
            idx = (phase + stride * torch.arange(num)) % count
            picked = cand[idx.unique()]  # unique also sorts
        anchors[b, : len(picked)] = picked
        keep[b, : len(picked)] = True
    return anchors, keep


def uniform_anchors(
    loss_mask_BS: torch.Tensor, num: int, generator: torch.Generator, depth: int = 2
) -> tuple[torch.Tensor, torch.Tensor]:
    """DFlash/DSpark: up to `num` anchors per row, uniformly without replacement among the candidates, sorted."""
    if num < 1:
        raise ValueError(f"anchors: need num >= 1, got {num}")
    B = loss_mask_BS.shape[0]
    anchors = torch.zeros(B, num, dtype=torch.long)
    keep = torch.zeros(B, num, dtype=torch.bool)
    for b in range(B):
        cand = candidates(loss_mask_BS[b], depth)
        take = min(num, len(cand))
        if take == 0:
            continue
        chosen = cand[torch.randperm(len(cand), generator=generator)[:take]].sort().values
        anchors[b, :take] = chosen
        keep[b, :take] = True
    return anchors, keep
