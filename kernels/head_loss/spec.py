"""The inputs and outputs of the fused output-head loss, shared by the reference and the Triton path.

Shape legend: T rows (counted positions), D drafter width, V output vocabulary, Ht target width, k top-k,
r extra (Markov) rank.
"""

from dataclasses import dataclass
from typing import NamedTuple

import torch

# Below every real logit: what a top-k target holds outside its k ids (p_t = 0 there).
FLOOR = -1.0e30


@dataclass(frozen=True)
class Target:
    """The target's distribution over the V output ids (temperature 1), in exactly one of three forms:
    `logits` `[T, V]`; `hidden` `[T, Ht]` with the frozen target `head` `[V, Ht]` (logits made a chunk of rows
    at a time, `hidden @ head.T`, never all of `[T, V]`); or `topk_ids` `[T, k]` with `topk_logp` `[T, k]`
    (renormalised over the k ids)."""

    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    head: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
    topk_logp: torch.Tensor | None = None

    def __post_init__(self) -> None:
        forms = [self.logits is not None, self.hidden is not None, self.topk_ids is not None]
        if sum(forms) != 1:
            raise ValueError("head_loss.target: give exactly one of logits, hidden (+ head), topk_ids (+ topk_logp)")
        if (self.hidden is None) != (self.head is None):
            raise ValueError("head_loss.target: hidden and head go together")
        if (self.topk_ids is None) != (self.topk_logp is None):
            raise ValueError("head_loss.target: topk_ids and topk_logp go together")

    def check(self, T: int, V: int) -> None:
        """Raise naming the field whose shape disagrees with `[T, V]`."""
        if self.logits is not None and tuple(self.logits.shape) != (T, V):
            raise ValueError(f"head_loss.target.logits: shape {tuple(self.logits.shape)}, expected {(T, V)}")
        if self.hidden is not None and self.head is not None:
            if self.hidden.shape[0] != T or self.head.shape[0] != V or self.hidden.shape[1] != self.head.shape[1]:
                raise ValueError(
                    f"head_loss.target: hidden {tuple(self.hidden.shape)} and head {tuple(self.head.shape)} "
                    f"do not make [T={T}, V={V}] logits"
                )
        if self.topk_ids is not None and self.topk_logp is not None:
            if self.topk_ids.shape != self.topk_logp.shape or self.topk_ids.shape[0] != T:
                raise ValueError(
                    f"head_loss.target: topk_ids {tuple(self.topk_ids.shape)} and topk_logp "
                    f"{tuple(self.topk_logp.shape)} must both be [T={T}, k]"
                )

    def rows(self, r0: int, r1: int, V: int) -> torch.Tensor:
        """Target logits of rows `r0:r1`, `[r1 - r0, V]` (any float dtype; FLOOR outside a top-k)."""
        if self.logits is not None:
            return self.logits[r0:r1]
        if self.hidden is not None and self.head is not None:
            return self.hidden[r0:r1].to(self.head.dtype) @ self.head.T
        assert self.topk_ids is not None and self.topk_logp is not None  # one form is given (__post_init__)
        ids, logp = self.topk_ids[r0:r1], self.topk_logp[r0:r1]
        out = torch.full((r1 - r0, V), FLOOR, dtype=torch.float32, device=ids.device)
        return out.scatter_(1, ids.long(), logp.float())


class HeadLossOut(NamedTuple):
    """`loss`: the scalar `sum_t w_soft*soft_ce + w_ce*ce + w_l1*l1` (the only differentiable output).
    Per row `[T]`, detached: `soft_ce` = -sum_v p_t log p_d (None without a target), `ce` = -log p_d(label)
    (None without labels), `l1` = sum_v |p_d - p_t| (None unless asked), `acc` = argmax p_d == argmax p_t,
    `hit` = argmax p_d == label."""

    loss: torch.Tensor
    soft_ce: torch.Tensor | None
    ce: torch.Tensor | None
    l1: torch.Tensor | None
    acc: torch.Tensor | None
    hit: torch.Tensor | None


def row_weights(
    T: int,
    device: torch.device,
    w_soft: torch.Tensor | None,
    w_ce: torch.Tensor | None,
    w_l1: torch.Tensor | None,
) -> torch.Tensor:
    """`[3, T]` fp32 per-row weights of (soft CE, CE, L1); a missing term weighs 0."""
    out = torch.zeros(3, T, dtype=torch.float32, device=device)
    for i, (name, w) in enumerate((("w_soft", w_soft), ("w_ce", w_ce), ("w_l1", w_l1))):
        if w is not None:
            if w.shape != (T,):
                raise ValueError(f"head_loss.{name}: shape {tuple(w.shape)}, expected ({T},)")
            out[i] = w.detach().float()
    return out
