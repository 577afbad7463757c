"""The EAGLE-3 TTT objective: forward KL to the target's distribution, depth-weighted.

Depth k at position t predicts the target distribution at position p = t + 1 + k (over token p + 1),
renormalised over the draft vocabulary. A target position p counts when token p + 1 is a loss token
and the target's argmax at p is in the draft vocabulary (otherwise no draft could be accepted).
Total = sum_k decay**k * L_k, each L_k a mean over its counted positions.

Only counted positions reach the lm_head: padding and prompt tokens never pay for the `[*, Vd]` logits.

Shape legend: B batch, S sequence, H drafter width, Vd draft vocabulary, n counted target positions.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from drafters.eagle3.model import shift_left


@dataclass(frozen=True)
class TTTLoss:
    """The weighted total and, per depth, the loss, argmax accuracy and counted positions."""

    total: torch.Tensor
    step_loss: torch.Tensor  # [depth]
    step_acc: torch.Tensor  # [depth]
    step_count: torch.Tensor  # [depth]


def position_mask(loss_mask_BS: torch.Tensor, in_draft_BS: torch.Tensor) -> torch.Tensor:
    """Mask over target positions p: token p + 1 is a loss token and argmax p is draftable."""
    return shift_left(loss_mask_BS.bool(), 1, False) & in_draft_BS.bool()


def ttt_loss(
    head: Callable[[torch.Tensor], torch.Tensor],
    step_hidden: list[torch.Tensor],
    target_logp_nV: torch.Tensor,
    mask_BS: torch.Tensor,
    decay: float,
) -> TTTLoss:
    """Depth-weighted soft cross-entropy (forward KL up to the target's entropy).

    Args:
        head: maps drafter hidden rows `[m, H]` to draft logits `[m, Vd]` (norm and lm_head).
        step_hidden: per depth, the drafter's output `[B, S, H]` at every position t.
        target_logp_nV: target log-probabilities over the draft vocabulary at the counted positions,
            i.e. at `mask_BS.nonzero()` in row-major order.
        mask_BS: `position_mask(...)` over target positions p.
        decay: depth k is weighted `decay**k`.
    """
    b, p = mask_BS.nonzero(as_tuple=True)
    losses, accs, counts = [], [], []
    for k, hidden in enumerate(step_hidden):
        keep = p >= 1 + k  # depth k at t = p - 1 - k needs t >= 0
        logits = head(hidden[b[keep], p[keep] - 1 - k]).float()
        target = target_logp_nV[keep]
        n = keep.sum()
        denom = n.clamp(min=1)
        losses.append(-(target.exp() * logits.log_softmax(-1)).sum() / denom)
        accs.append((logits.argmax(-1) == target.argmax(-1)).sum() / denom)
        counts.append(n)
    step_loss = torch.stack(losses)
    weights = decay ** torch.arange(len(step_hidden), dtype=step_loss.dtype)
    return TTTLoss(
        total=(weights * step_loss).sum(),
        step_loss=step_loss,
        step_acc=torch.stack(accs),
        step_count=torch.stack(counts),
    )


def simulated_acc_len(step_acc: torch.Tensor) -> float:
    """Training-time proxy `1 + sum_k prod_{j<=k} acc_j` (a chain stops at its first miss)."""
    return float(1.0 + step_acc.cumprod(0).sum())
