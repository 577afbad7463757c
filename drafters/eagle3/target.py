"""The target side of the EAGLE-3 objective: which positions count, and the target's logits over the draft vocabulary.

A target position p counts when token p + 1 is a loss token and the target's full-vocabulary argmax at p is in
the draft vocabulary (`family.draftable`, the reference, pays `last_hidden @ head.T` over all V ids for that).
`SharedTarget` gets the same mask and the logits the loss needs from one product per step:

- the draft-vocabulary logits `[m, Vd]` at the loss positions are made once; they give the draft side's maximum
  for the argmax test and, at the counted positions, the target distribution every TTT depth reuses;
- the argmax test needs only the maximum over the other `V - Vd` ids, and only the first time a sample is seen:
  the answer depends on the sample's target hidden states and the frozen head alone, so it is cached per sample
  (keyed by a digest of those hidden states' bytes) and later epochs skip the `[m, V - Vd]` product.

It holds `[m, Vd]` logits for the whole micro-batch, so the trainer uses it off CUDA (`use_shared_target`); on
CUDA the fused kernel makes the target logits a chunk at a time from the hidden states instead.

Shape legend: B batch, S sequence, V target vocabulary, Vd draft vocabulary, Ht target width, m loss positions,
n counted positions (row-major order of the mask).
"""

import hashlib

import numpy as np
import torch

from draftsmith.drafters import vocab
from draftsmith.drafters.eagle3.model import shift_left

# Rows of the `[rows, V - Vd]` product made at once (64 MiB of fp32 at SmolLM2's 41K other ids).
REST_BUDGET = 1 << 24
# Bytes of packed per-sample masks kept (8 positions a byte): half a million samples of 1K tokens.
CACHE_BYTES = 1 << 26


def use_shared_target(head_VHt: torch.Tensor) -> bool:
    """Off CUDA the whole micro-batch's draft-vocabulary target logits fit beside the drafter's own."""
    return head_VHt.device.type != "cuda"


def in_draft(
    z_draft_mVd: torch.Tensor,
    hidden_mHt: torch.Tensor,
    rest_head_RHt: torch.Tensor,
    draft_ids_Vd: torch.Tensor,
    rest_ids_R: torch.Tensor,
) -> torch.Tensor:
    """`[m]` bool: is `argmax_v (hidden @ head.T)[v]` over all V ids a draft id? `torch.argmax` takes the first
    maximum, so a tie goes to the smaller id. R = V - Vd other ids, `rest_head_RHt` their head rows."""
    d_max, d_arg = z_draft_mVd.max(-1)
    if rest_ids_R.numel() == 0:  # the draft vocabulary is the whole target vocabulary
        return torch.ones_like(d_max, dtype=torch.bool)
    out = torch.empty_like(d_max, dtype=torch.bool)
    step = max(1, REST_BUDGET // max(rest_ids_R.numel(), 1))
    for r0 in range(0, hidden_mHt.shape[0], step):
        r1 = min(hidden_mHt.shape[0], r0 + step)
        r_max, r_arg = (hidden_mHt[r0:r1] @ rest_head_RHt.T).max(-1)
        dm = d_max[r0:r1]
        tie = (dm == r_max) & (draft_ids_Vd[d_arg[r0:r1]] < rest_ids_R[r_arg])
        out[r0:r1] = (dm > r_max) | tie
    return out


class SharedTarget:
    """`(mask_BS, logits_nVd)` per batch: the counted positions and the target's draft-vocabulary logits there,
    from one `[m, Vd]` product plus, for samples not seen before, the maximum over the other ids."""

    def __init__(self, head_VHt: torch.Tensor, d2t_Vd: torch.Tensor, t2d_V: torch.Tensor, cache_bytes=CACHE_BYTES):
        self.draft_ids = vocab.draft_ids(d2t_Vd).to(head_VHt.device)
        self.rest_ids = (~t2d_V).nonzero().squeeze(1).to(head_VHt.device)
        self.draft_head = head_VHt[self.draft_ids]  # [Vd, Ht]
        self.head = head_VHt  # the other ids' rows are gathered per cache miss, not held as a second copy
        self.cache: dict[bytes, np.ndarray] = {}
        self.cache_left = cache_bytes

    @torch.no_grad()
    def __call__(self, loss_mask_BS: torch.Tensor, last_hidden_BSHt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        needed = shift_left(loss_mask_BS.bool(), 1, False)  # token p + 1 is a loss token
        hidden = last_hidden_BSHt[needed].to(self.draft_head.dtype)  # [m, Ht], rows in row-major order
        z = hidden @ self.draft_head.T  # [m, Vd]
        if self.rest_ids.numel() == 0:  # the whole target vocabulary drafts: every loss position counts
            return needed, z
        keep = torch.cat([self._row_in_draft(needed[b], hidden, z, b, needed) for b in range(needed.shape[0])])
        mask = needed.clone()
        mask[needed] = keep
        return mask, z[keep]

    def _row_in_draft(self, needed_S, hidden_mHt, z_mVd, b, needed_BS) -> torch.Tensor:
        """Row b's `[m_b]` draft-vocabulary test, from the cache when this sample was seen before."""
        start = int(needed_BS[:b].sum())
        rows = slice(start, start + int(needed_S.sum()))
        h = hidden_mHt[rows]
        key = hashlib.blake2b(h.cpu().contiguous().view(torch.uint8).numpy().tobytes(), digest_size=16).digest()
        packed = self.cache.get(key)
        if packed is not None:
            return torch.from_numpy(np.unpackbits(packed, count=h.shape[0]).astype(bool)).to(h.device)
        out = in_draft(z_mVd[rows], h, self.head[self.rest_ids], self.draft_ids, self.rest_ids)
        packed = np.packbits(out.cpu().numpy())
        if packed.nbytes + len(key) <= self.cache_left:
            self.cache[key] = packed
            self.cache_left -= packed.nbytes + len(key)
        return out
