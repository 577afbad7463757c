"""Anchor sampling for anchored EAGLE-3 TTT and for DFlash/DSpark blocks: a fixed number of slots per row.

Slots are fixed (`N` per row, with a keep mask) so that masks and shapes never change between steps
(no flex-attention recompiles); a row with fewer candidates keeps fewer slots. Dropped slots hold anchor 0.

Shape legend: B batch, S sequence, N slots.
"""

from collections.abc import Callable

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

    def pick(cand: torch.Tensor) -> torch.Tensor:
        count = len(cand)
        if count <= num:
            return cand
        stride = min(max(count // num, 1), max_gap + 1)
        phase = int(torch.randint(count, (1,), generator=generator))
        return cand[((phase + stride * torch.arange(num)) % count).unique()]  # unique also sorts

    return _fill_slots(loss_mask_BS, num, depth, pick)


def uniform_anchors(
    loss_mask_BS: torch.Tensor, num: int, generator: torch.Generator, depth: int = 2
) -> tuple[torch.Tensor, torch.Tensor]:
    """DFlash/DSpark: up to `num` anchors per row, uniformly without replacement among the candidates, sorted."""
    if num < 1:
        raise ValueError(f"anchors: need num >= 1, got {num}")

    def pick(cand: torch.Tensor) -> torch.Tensor:
        return cand[torch.randperm(len(cand), generator=generator)[:num]].sort().values

    return _fill_slots(loss_mask_BS, num, depth, pick)


def _fill_slots(
    loss_mask_BS: torch.Tensor, num: int, depth: int, pick: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """`anchors`, `keep` `[B, num]` on the mask's device: each row's picked candidates first, the rest dropped
    (anchor 0)."""
    # The objective's generator is a CPU one (a micro-batch's seed gives the same anchors whatever device
    # trains it), and the per-row search is host work anyway (`len(cand)`): one copy of the mask to the host
    # instead of a sync per row, then the slots go to the mask's device. On CPU both moves are no-ops.
    mask_BS = loss_mask_BS.cpu()
    B = mask_BS.shape[0]
    anchors = torch.zeros(B, num, dtype=torch.long)
    keep = torch.zeros(B, num, dtype=torch.bool)
    for b in range(B):
        cand = candidates(mask_BS[b], depth)
        if len(cand) == 0:
            continue
        picked = pick(cand)
        anchors[b, : len(picked)] = picked
        keep[b, : len(picked)] = True
    return anchors.to(loss_mask_BS.device), keep.to(loss_mask_BS.device)
