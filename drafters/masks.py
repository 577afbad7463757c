"""Attention masks of the drafters as flex-attention `mask_mod`s, with dense and block-sparse forms.

A `mask_mod(b, h, q, kv) -> bool` says whether query q may attend to key kv in batch row b. The same
function gives `dense(...)`, a `[B, 1, Q, K]` boolean mask for SDPA (cheaper at the small shapes of CPU
tests), and `block_mask(...)` for `flex_attention` (block-sparse on GPU). Every mask here has a test
against a loop-by-loop reference built from the spec in `algorithms.md`.

Conventions: `doc_BS` gives each position's document id (packed sequences), -1 for padding; a query row
that may see nothing instead sees itself (masked out of every loss), so attention stays finite.
Shape legend: B batch, S sequence, N anchors (slots), Q queries, K keys.
"""

from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def doc_causal(doc_BS: torch.Tensor) -> MaskMod:
    """Causal within a document, nothing across documents or into padding."""

    def mod(b, h, q, kv):
        return (q >= kv) & (doc_BS[b, q] == doc_BS[b, kv]) & (doc_BS[b, kv] >= 0)

    return mod


def sliding_window(base: MaskMod, window: int) -> MaskMod:
    """`base`, restricted to the last `window` keys before (and at) the query (sliding-window layers)."""
    if window < 1:
        raise ValueError(f"window: must be at least 1, got {window}")

    def mod(b, h, q, kv):
        return base(b, h, q, kv) & (q - kv < window)

    return mod


def ttt(doc_BS: torch.Tensor, depth: int) -> MaskMod:
    """EAGLE-3 training-time test at step `depth`: keys are `[step 0 | step 1 | ... | step depth]`, S each.

    Query t sees the step-0 keys causally (within its document) and, from each later step, only the key
    at its own position t (the diagonal), as SpecForge and speculators do.
    """
    S = doc_BS.shape[1]
    causal = doc_causal(doc_BS)

    def mod(b, h, q, kv):
        step, pos = kv // S, kv % S
        return torch.where(step == 0, causal(b, h, q, pos), (pos == q) & (step <= depth))

    return mod


def dflash_blocks(anchors_BN: torch.Tensor, keep_BN: torch.Tensor, ctx_len: int, block: int) -> MaskMod:
    """DFlash/DSpark training: N blocks of `block` queries packed after `ctx_len` context keys.

    Keys are `[context (ctx_len) | block 0 | ... | block N-1]`; queries are the blocks. Block n sees the
    context strictly before its anchor (the anchor's own target state does not exist at inference) and
    all of its own block, bidirectionally; never another block. A dropped slot (`keep` false) sees itself.
    """

    def mod(b, h, q, kv):
        n = q // block
        a, kept = anchors_BN[b, n], keep_BN[b, n]
        in_ctx = kv < ctx_len
        own_block = (kv - ctx_len) // block == n
        seen = torch.where(in_ctx, kv < a, own_block)
        return torch.where(kept, seen, kv == ctx_len + q)

    return mod


def anchored_ttt(anchors_BN: torch.Tensor, keep_BN: torch.Tensor, ctx_len: int, depth: int) -> MaskMod:
    """Anchored EAGLE-3 at chain depth `depth` (>= 1): queries are the N anchor slots.

    Keys are `[context (ctx_len) | depth-1 slots (N) | ... | depth slots (N)]`. Slot n sees the context up
    to and including its anchor and its own slot in each chain block; anchors never see each other.
    A dropped slot sees only its own newest key.
    """
    N = anchors_BN.shape[1]

    def mod(b, h, q, kv):
        a, kept = anchors_BN[b, q], keep_BN[b, q]
        chain = kv - ctx_len
        seen = torch.where(kv < ctx_len, kv <= a, (chain % N == q) & (chain // N < depth))
        return torch.where(kept, seen, kv == ctx_len + (depth - 1) * N + q)

    return mod


def dense(mod: MaskMod, B: int, Q: int, K: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """`[B, 1, Q, K]` bool for SDPA's `attn_mask`, on `device` (the device of the tensors `mod` reads)."""
    return create_mask(mod, B, None, Q, K, device=device)


def block_mask(mod: MaskMod, B: int, Q: int, K: int, device: str = "cpu") -> BlockMask:
    """The block-sparse form for `flex_attention`."""
    return create_block_mask(mod, B, None, Q, K, device=device)
