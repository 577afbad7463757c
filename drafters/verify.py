"""Verification rules: which drafted tokens the target accepts.

Greedy (temperature 0): draft token i is accepted iff it equals the target's argmax given the
accepted prefix; verification stops at the first mismatch. The target's own argmax at that point is
emitted as the correction (or, when every draft was accepted, as the bonus token), so every round
emits accepted + 1 tokens and the output is exactly the target's greedy output.
"""

import torch


def greedy_verify(draft_ids: torch.Tensor, target_argmax: torch.Tensor) -> tuple[int, list[int]]:
    """Accepted count and the tokens this round emits.

    Args:
        draft_ids: `[g]` drafted token ids (target vocabulary).
        target_argmax: `[g + 1]` target argmax after the last verified token and after each draft.
    """
    matches = (draft_ids == target_argmax[: draft_ids.numel()]).int()
    accepted = int(matches.cumprod(0).sum())
    return accepted, draft_ids[:accepted].tolist() + [int(target_argmax[accepted])]
