"""The block drafter backbone (DFlash, DFlash2, DSpark's trunk), computed as vLLM's `qwen3_dflash.py` does.

Context: `ctx = fc(cat(fc_norm_i(tap_i)))`; each layer's context K/V = `k_norm(k_proj(hidden_norm(ctx)))` rotated
at the context positions and `v_proj(hidden_norm(ctx))` (the context never goes through `input_layernorm` or an
MLP). Block stream: `embed -> [input_layernorm -> (conv) q/k/v, q_norm/k_norm, RoPE -> attention over
[ctx | block] -> o_proj (conv) + residual -> post_attention_layernorm -> (conv) SwiGLU (conv) + residual] x L
-> norm`. Parameter names are the ones vLLM loads, so export is a dtype cast plus config.json.

Shape legend: B batch, S sequence, F = num_taps * Ht feature width, H drafter width, N blocks per row,
Q queries, K keys, V target vocabulary, Vd draft vocabulary.
"""

from collections.abc import Sequence
from typing import cast

import torch
from torch import nn

from draftsmith.drafters.dflash.block_attention import SplitMask
from draftsmith.drafters.dflash.block_masks import decode_mask, split_train_mask
from draftsmith.drafters.dflash.layers import DFlashGQA, DFlashMLA, GroupedConv
from draftsmith.drafters.dflash.selector import CandidateSelector
from draftsmith.drafters.dflash.spec import DFlashSpec
from draftsmith.drafters.layers import OutputHead, RMSNorm, SwiGLU, multi_rms_norm

KV = tuple[torch.Tensor, torch.Tensor]


class DFlashLayer(nn.Module):
    """One draft decoder layer; with `conv_kernel_size` the DFlash2 convs wrap both sublayers."""

    # Called outside `forward` (the context K/V are projected before the blocks run): FSDP must gather for it.
    fsdp_forward_methods = ("context_kv",)

    def __init__(self, spec: DFlashSpec) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = DFlashMLA(spec) if spec.attention == "mla" else DFlashGQA(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = SwiGLU(spec.hidden_size, spec.intermediate_size)
        if spec.conv_kernel_size:
            args = (spec.hidden_size, spec.conv_kernel_size, spec.conv_group_size, spec.block_size)
            self.attention_conv = GroupedConv(*args)
            self.mlp_conv = GroupedConv(*args)
        self.conv = bool(spec.conv_kernel_size)

    def context_kv(self, ctx_BSH: torch.Tensor, positions_BS: torch.Tensor) -> KV:
        """This layer's `(k, v)` `[B, heads, S, d]` of the normed context."""
        return self.self_attn.kv(ctx_BSH, positions_BS)

    def forward(self, x_BQH: torch.Tensor, positions: torch.Tensor, ctx_kv: KV, mask: torch.Tensor) -> torch.Tensor:
        h = self.input_layernorm(x_BQH)
        if self.conv:
            h, delta = self.attention_conv.prepare(h)
        a = self.self_attn(h, positions, ctx_kv, mask)
        if self.conv:
            a = self.attention_conv.finish(a, delta)
        x_BQH = x_BQH + a
        h = self.post_attention_layernorm(x_BQH)
        if self.conv:
            h, delta = self.mlp_conv.prepare(h)
        m = self.mlp(h)
        if self.conv:
            m = self.mlp_conv.finish(m, delta)
        return x_BQH + m


class DFlashDrafter(nn.Module):
    """Block drafter. `embed_tokens` is the target's, frozen; so is `lm_head` unless the vocabulary is pruned."""

    # Buffers (`register_buffer`, with a pruned vocabulary), declared so that they type as tensors.
    d2t: torch.Tensor
    t2d: torch.Tensor

    def __init__(self, spec: DFlashSpec) -> None:
        super().__init__()
        self.spec = spec
        H = spec.hidden_size
        self.embed_tokens = nn.Embedding(spec.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)
        if spec.fc_norm:
            self.fc_norm = nn.ModuleList(
                RMSNorm(spec.target_hidden_size, spec.rms_norm_eps) for _ in range(spec.num_taps)
            )
        self.fc = nn.Linear(spec.num_taps * spec.target_hidden_size, H, bias=False)
        self.hidden_norm = RMSNorm(H, spec.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(spec) for _ in range(spec.num_layers))
        self.norm = RMSNorm(H, spec.rms_norm_eps)
        self.lm_head = OutputHead(H, spec.draft_vocab_size or spec.vocab_size)
        if spec.draft_vocab_size is None:
            self.lm_head.weight.requires_grad_(False)
        else:
            self.register_buffer("d2t", torch.zeros(spec.draft_vocab_size, dtype=torch.int64))
            self.register_buffer("t2d", torch.zeros(spec.vocab_size, dtype=torch.bool))
        if spec.selector_rank:
            self.candidate_selector = CandidateSelector(H, spec.vocab_size, spec.selector_rank, spec.selector_top_k)

    def context(self, features_BSF: torch.Tensor) -> torch.Tensor:
        """`[B, S, H]` = `fc(cat(fc_norm_i(tap_i)))`; `hidden_norm` is applied in `context_kv`, as vLLM does."""
        if self.spec.fc_norm:
            features_BSF = multi_rms_norm(self.fc_norm, features_BSF)
        return self.fc(features_BSF)

    def context_kv(self, ctx_BSH: torch.Tensor, positions_BS: torch.Tensor) -> list[KV]:
        """Per layer `(k, v)` `[B, heads, S, d]` of the context, normed and rotated, ready to attend."""
        x = self.hidden_norm(ctx_BSH)
        return [layer.context_kv(x, positions_BS) for layer in cast(list[DFlashLayer], self.layers)]

    def blocks(
        self,
        ids_BQ: torch.Tensor,
        positions_BQ: torch.Tensor,
        ctx_kv: list[KV],
        masks: Sequence[torch.Tensor | SplitMask],
    ) -> torch.Tensor:
        """`[B, Q, H]` after the final norm; `masks` per layer `[B, 1, Q, Kc + Q]` bool over `[ctx | queries]`."""
        x = self.embed_tokens(ids_BQ)
        for layer, kv, mask in zip(self.layers, ctx_kv, masks, strict=True):
            x = layer(x, positions_BQ, kv, mask)
        return self.norm(x)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """`[..., Vout]` (Vout = draft_vocab_size or vocab_size) from `blocks` output `[..., H]`."""
        return self.lm_head(h)

    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Output ids -> target ids (identity without pruning)."""
        return ids if self.spec.draft_vocab_size is None else ids + self.d2t[ids]

    def block_inputs(self, input_ids_BS: torch.Tensor, anchors_BN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ids `[B, N*block]` (`[anchor token, MASK x (block-1)]` each) and their positions `a..a+block-1`."""
        B, N = anchors_BN.shape
        block = self.spec.block_size
        ids = torch.full((B, N, block), self.spec.mask_token_id, dtype=input_ids_BS.dtype, device=input_ids_BS.device)
        ids[:, :, 0] = input_ids_BS.gather(1, anchors_BN)
        positions = anchors_BN[:, :, None] + torch.arange(block, device=anchors_BN.device)
        return ids.view(B, N * block), positions.view(B, N * block)

    def train_hidden(
        self, input_ids_BS: torch.Tensor, features_BSF: torch.Tensor, anchors_BN: torch.Tensor, keep_BN: torch.Tensor
    ) -> torch.Tensor:
        """`[B, N, block, H]`: every anchor's block in one packed forward after the whole context.

        Block n sees context taps at positions < its anchor; per layer the masks of `block_masks.train_mask`,
        kept in their context and own-block parts (`block_attention`).
        Equal, block by block, to `blocks` over `context_kv(taps < a)` with `decode_masks` (tested).
        """
        B, S = input_ids_BS.shape
        N, block = anchors_BN.shape[1], self.spec.block_size
        positions_S = torch.arange(S, device=input_ids_BS.device)
        ctx_kv = self.context_kv(self.context(features_BSF), positions_S)
        ids, positions = self.block_inputs(input_ids_BS, anchors_BN)
        cache: dict[tuple, torch.Tensor | SplitMask] = {}
        masks = []
        for i in range(self.spec.num_layers):
            kind = self.spec.layer_attention(i)
            if kind not in cache:
                cache[kind] = split_train_mask(anchors_BN, keep_BN, S, block, *kind)
            masks.append(cache[kind])
        return self.blocks(ids, positions, ctx_kv, masks).view(B, N, block, -1)

    def decode_masks(self, ctx_positions_K: torch.Tensor, block_positions_Q: torch.Tensor) -> list[torch.Tensor]:
        """Per layer `[1, 1, Q, K + Q]` bool for one request (anchor at `block_positions_Q[0]`)."""
        return [
            decode_mask(ctx_positions_K, block_positions_Q, *self.spec.layer_attention(i))
            for i in range(self.spec.num_layers)
        ]
