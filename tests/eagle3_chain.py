"""The EAGLE-3 training-time test checked against inference: TTT depth k at position t must equal chain step k
of cached decoding after a context of positions 0..t (teacher-forced tokens)."""

import torch

from draftsmith.drafters.eagle3.decode import DraftCache, _draft_forward
from draftsmith.drafters.eagle3.model import Eagle3Drafter


def check_chain_matches_ttt(
    model: Eagle3Drafter, ids_1S: torch.Tensor, feats_1SF: torch.Tensor, depth: int, positions: range
) -> list[DraftCache]:
    """Assert equality (1e-5) at every depth for each start `t` in `positions`; returns each chain's cache."""
    ttt = model.ttt_forward(ids_1S, feats_1SF, depth)
    caches = []
    for t in positions:
        cache = DraftCache()
        logits, hidden = _draft_forward(model, ids_1S[0, 1 : t + 2], model.fuse(feats_1SF[:, : t + 1])[0], 0, cache)
        torch.testing.assert_close(logits[-1], ttt[0][0, t], rtol=1e-5, atol=1e-5)
        hidden = hidden[-1:]
        for k in range(1, depth):
            logits, hidden = _draft_forward(model, ids_1S[0, t + 1 + k].view(1), hidden, t + k, cache)
            torch.testing.assert_close(logits[-1], ttt[k][0, t], rtol=1e-5, atol=1e-5)
        caches.append(cache)
    return caches
