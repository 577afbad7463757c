"""The EAGLE-3 TTT objective: forward KL to the target's distribution, depth-weighted.

Depth k at position t predicts the target distribution at position t + 1 + k (over token t + 2 + k),
renormalised over the draft vocabulary. A position counts when the token it predicts is a loss token
and the target's argmax there is in the draft vocabulary (otherwise no draft could be accepted).
Total = sum_k decay**k * L_k, each L_k a mean over its counted positions.

Shape legend: B batch, S sequence, Vd draft vocabulary.
"""

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
    step_logits: list[torch.Tensor], target_logp_BSV: torch.Tensor, mask_BS: torch.Tensor, decay: float
) -> TTTLoss:
    """Depth-weighted soft cross-entropy (forward KL up to the target's entropy).

    Args:
        step_logits: per depth, draft logits `[B, S, Vd]` (position t of depth k).
        target_logp_BSV: target log-probabilities over the draft vocabulary at each position p.
        mask_BS: `position_mask(...)` over target positions p.
        decay: depth k is weighted `decay**k`.
    """
    losses, accs, counts = [], [], []
    for k, logits in enumerate(step_logits):
        target = shift_left(target_logp_BSV, 1 + k)
        mask = shift_left(mask_BS, 1 + k, False)
        ce = -(target.exp() * logits.float().log_softmax(-1)).sum(-1)
        n = mask.sum()
        denom = n.clamp(min=1)
        losses.append((ce * mask).sum() / denom)
        accs.append(((logits.argmax(-1) == target.argmax(-1)) & mask).sum() / denom)
        counts.append(n)
    step_loss = torch.stack(losses)
    weights = decay ** torch.arange(len(step_logits), dtype=step_loss.dtype)
    return TTTLoss(
        total=(weights * step_loss).sum(),
        step_loss=step_loss,
        step_acc=torch.stack(accs),
        step_count=torch.stack(counts),
    )


def simulated_acc_len(step_acc: torch.Tensor) -> float:
    """Training-time proxy `1 + sum_k prod_{j<=k} acc_j` (a chain stops at its first miss)."""
    return float(1.0 + step_acc.cumprod(0).sum())
