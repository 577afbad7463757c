"""The EAGLE-3 TTT objective: forward KL to the target's distribution, depth-weighted.

Depth k at position t predicts the target distribution at position p = t + 1 + k (over token p + 1),
renormalised over the draft vocabulary. A target position p counts when token p + 1 is a loss token
and the target's argmax at p is in the draft vocabulary (otherwise no draft could be accepted).
Total = sum_k decay**k * L_k, each L_k a mean over its counted positions.

Only counted positions reach the lm_head: padding and prompt tokens never pay for the `[*, Vd]` logits.
`ttt_loss_fused` computes the same through `draftsmith.kernels.head_loss` (the Triton kernel on CUDA), which never holds
all `[n, Vd]` logits of the drafter or of the target at once.

Shape legend: B batch, S sequence, H drafter width, Vd draft vocabulary, n counted target positions.
"""

from collections.abc import Callable, Sequence

import torch

from draftsmith.drafters.eagle3.model import Eagle3Drafter, shift_left
from draftsmith.drafters.layers import HeadLossCall
from draftsmith.drafters.objective import StepLoss, simulated_acc_len
from draftsmith.kernels import Target

# EAGLE-3 reports the common per-slot step figures (a slot is a TTT depth here).
TTTLoss = StepLoss


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
    terms = []
    for k, hidden in enumerate(step_hidden):
        keep = p >= 1 + k  # depth k at t = p - 1 - k needs t >= 0
        terms.append(depth_term(head(hidden[b[keep], p[keep] - 1 - k]).float(), target_logp_nV[keep]))
    return combine(terms, decay)


def ttt_loss_fused(
    model: Eagle3Drafter,
    step_hidden: list[torch.Tensor],
    last_hidden_nHt: torch.Tensor,
    draft_head_VdHt: torch.Tensor,
    mask_BS: torch.Tensor,
    decay: float,
) -> TTTLoss:
    """`ttt_loss` by the fused head loss: the target distribution at the counted positions is
    `softmax(last_hidden_nHt @ draft_head_VdHt.T)`, made a chunk of rows at a time.

    Args:
        model: the drafter (its `norm` and `lm_head`, an `OutputHead`).
        step_hidden: per depth, the drafter's output `[B, S, H]`.
        last_hidden_nHt: the target's post-norm last hidden state at `mask_BS.nonzero()` (row-major) `[n, Ht]`.
        draft_head_VdHt: the target's lm_head rows of the draft vocabulary `[Vd, Ht]`.
        mask_BS, decay: as `ttt_loss`.
    """
    return _fused_terms(
        model, step_hidden, mask_BS, decay, lambda keep: Target(hidden=last_hidden_nHt[keep], head=draft_head_VdHt)
    )


def ttt_loss_shared(
    model: Eagle3Drafter,
    step_hidden: list[torch.Tensor],
    target_logits_nVd: torch.Tensor,
    mask_BS: torch.Tensor,
    decay: float,
) -> TTTLoss:
    """`ttt_loss_fused` with the target's draft-vocabulary logits made once per step (`target.SharedTarget`)
    and sliced for every depth, instead of `last_hidden @ draft_head.T` again at each depth.

    Args:
        target_logits_nVd: the target's logits over the draft vocabulary at `mask_BS.nonzero()` `[n, Vd]`.
        model, step_hidden, mask_BS, decay: as `ttt_loss_fused`.
    """
    return _fused_terms(model, step_hidden, mask_BS, decay, lambda keep: Target(logits=target_logits_nVd[keep]))


def _fused_terms(model, step_hidden, mask_BS, decay, target_of: Callable[[torch.Tensor], Target]) -> TTTLoss:
    """Per depth k the fused head loss over the counted positions it reaches; `target_of(keep [n])` gives
    the target rows of those positions."""
    b, p = mask_BS.nonzero(as_tuple=True)
    terms = []
    for k, hidden in enumerate(step_hidden):
        keep = p >= 1 + k  # depth k at t = p - 1 - k needs t >= 0
        rows = model.norm(hidden[b[keep], p[keep] - 1 - k])
        n = rows.shape[0]
        mean = torch.full((n,), 1.0 / max(n, 1), device=rows.device)
        out = model.lm_head.fused_loss(rows, HeadLossCall(target=target_of(keep), w_soft=mean))
        terms.append((out.loss, out.acc.float().sum() / max(n, 1), torch.tensor(n, device=rows.device)))
    return combine(terms, decay)


def depth_term(logits_nVd: torch.Tensor, target_logp_nVd: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One depth's soft cross-entropy mean, argmax accuracy and count over its n counted positions."""
    n = torch.tensor(logits_nVd.shape[0], device=logits_nVd.device)
    denom = n.clamp(min=1)
    loss = -(target_logp_nVd.exp() * logits_nVd.log_softmax(-1)).sum() / denom
    acc = (logits_nVd.argmax(-1) == target_logp_nVd.argmax(-1)).sum() / denom
    return loss, acc, n


def combine(terms: Sequence[tuple[torch.Tensor, ...]], decay: float) -> TTTLoss:
    """`TTTLoss` from per-depth `(loss, acc, count)`, depth k weighted `decay**k`."""
    step_loss = torch.stack([t[0] for t in terms])
    weights = decay ** torch.arange(len(terms), dtype=step_loss.dtype, device=step_loss.device)
    return TTTLoss(
        total=(weights * step_loss).sum(),
        step_loss=step_loss,
        step_acc=torch.stack([t[1] for t in terms]),
        step_count=torch.stack([t[2] for t in terms]),
    )


__all__ = [
    "TTTLoss",
    "combine",
    "depth_term",
    "position_mask",
    "simulated_acc_len",
    "ttt_loss",
    "ttt_loss_fused",
    "ttt_loss_shared",
]
