"""Dense per-layer attention masks of the block drafters, for training (packed blocks) and decoding.

Keys are `[context | block queries]`. A block query at position p (slot k of the block at anchor a, p = a + k):
- sees a context key at position c iff c < a (the anchor's own target state does not exist at inference);
- sees a key of its own block at position p' iff the layer is bidirectional or p' <= p (vLLM: sliding
  layers are causal inside the block, full layers bidirectional), and never another block;
- on a sliding layer with window W, additionally only keys with position > p - W (context and block alike).
A dropped training slot (`keep` false) sees only itself, so no softmax row is empty.

Shape legend: B batch, N blocks per row, Q queries, K keys.
"""

import torch

from draftsmith.drafters.dflash.block_attention import SplitMask


def train_mask(
    anchors_BN: torch.Tensor, keep_BN: torch.Tensor, ctx_len: int, block: int, window: int | None, causal: bool
) -> torch.Tensor:
    """`[B, 1, N*block, ctx_len + N*block]` bool for `N` blocks packed after `ctx_len` context keys (the dense
    form of `split_train_mask`, which training uses)."""
    return split_train_mask(anchors_BN, keep_BN, ctx_len, block, window, causal).dense()


def decode_mask(
    ctx_positions_K: torch.Tensor, block_positions_Q: torch.Tensor, window: int | None, causal: bool
) -> torch.Tensor:
    """`[1, 1, Q, K + Q]` bool for one request's block (anchor at `block_positions_Q[0]`)."""
    q = block_positions_Q[:, None]
    ctx = ctx_positions_K[None, :] < block_positions_Q[0]
    ctx = ctx.expand(len(block_positions_Q), -1)
    blk = torch.ones(len(block_positions_Q), len(block_positions_Q), dtype=torch.bool, device=q.device)
    if causal:
        blk = blk & (block_positions_Q[None, :] <= q)
    if window is not None:
        ctx = ctx & (ctx_positions_K[None, :] > q - window)
        blk = blk & (block_positions_Q[None, :] > q - window)
    return torch.cat([ctx, blk], dim=1)[None, None]


def split_train_mask(
    anchors_BN: torch.Tensor, keep_BN: torch.Tensor, ctx_len: int, block: int, window: int | None, causal: bool
) -> SplitMask:
    """`train_mask` in two parts (`block_attention.SplitMask`): the context part `[B, 1, N*block, ctx_len]` and
    each block's own part `[B, 1, N, block, block]`; `.dense()` is `train_mask`."""
    B, N = anchors_BN.shape
    dev = anchors_BN.device
    slot = torch.arange(block, device=dev)
    q_pos = (anchors_BN[:, :, None] + slot).reshape(B, N * block)  # [B, Q]
    q_anchor = anchors_BN.repeat_interleave(block, dim=1)  # [B, Q]
    ctx_pos = torch.arange(ctx_len, device=dev)
    ctx = ctx_pos[None, None, :] < q_anchor[:, :, None]  # [B, Q, S]
    own = torch.ones(block, block, dtype=torch.bool, device=dev)  # [query slot, key slot], same anchor
    if causal:
        own = own & (slot[None, :] <= slot[:, None])
    if window is not None:
        ctx = ctx & (ctx_pos[None, None, :] > q_pos[:, :, None] - window)
        own = own & (slot[None, :] > slot[:, None] - window)
    kept = keep_BN.bool()  # [B, N]
    ctx = ctx & kept.repeat_interleave(block, dim=1)[:, :, None]
    eye = torch.eye(block, dtype=torch.bool, device=dev)
    own = torch.where(kept[:, :, None, None], own, eye)  # [B, N, b, b]
    return SplitMask(ctx[:, None], own[:, None])
