"""What one training step of any drafter reports: a weighted total plus per-slot figures.

A "slot" is a TTT depth for EAGLE-3 and a block position for DFlash/DSpark; the trainer only needs
these four tensors, so every drafter's objective returns this one type.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepLoss:
    """The weighted total and, per slot, the loss, argmax accuracy and counted positions."""

    total: torch.Tensor
    step_loss: torch.Tensor  # [slots]
    step_acc: torch.Tensor  # [slots]
    step_count: torch.Tensor  # [slots]


def simulated_acc_len(step_acc: torch.Tensor) -> float:
    """Training-time proxy `1 + sum_k prod_{j<=k} acc_j` (a chain stops at its first miss)."""
    return float(1.0 + step_acc.cumprod(0).sum())
