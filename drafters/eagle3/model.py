"""The EAGLE-3 drafter: one decoder layer over fused target taps, with a pruned output vocabulary.

Parameter names follow vLLM's `LlamaForCausalLMEagle3` checkpoint keys (`fc`, `midlayer.*`, `norm`,
`lm_head`, `d2t`, `t2d`), so export is a dtype cast and a config file.

The attention is GQA (`LlamaForCausalLMEagle3`) or MLA (`Eagle3DeepseekV3ForCausalLM`, e.g. Kimi K3's
eagle3.1-mla seed drafter), chosen by `Eagle3Spec.attention`; see `draftsmith.drafters.eagle3.attention` for the
interface every path uses.

Shape legend: B batch, S sequence, H drafter width, Ht target width, N taps, h heads, g kv heads,
d head width (dqk for q/k, dv for v), V target vocabulary, Vd draft vocabulary, K keys.
"""

import torch
from torch import nn

from draftsmith.drafters.eagle3.attention import make_attention
from draftsmith.drafters.eagle3.chain_attention import chain_attention
from draftsmith.drafters.eagle3.spec import Eagle3Spec
from draftsmith.drafters.layers import OutputHead, RMSNorm, SwiGLU, multi_rms_norm


class Eagle3Layer(nn.Module):
    """The single draft decoder layer; the residual runs through `hidden`, not the concatenation."""

    def __init__(self, spec: Eagle3Spec) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.hidden_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = make_attention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = SwiGLU(spec.hidden_size, spec.intermediate_size)

    def attn_input(self, embeds_BSH: torch.Tensor, hidden_BSH: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_layernorm(embeds_BSH), self.hidden_norm(hidden_BSH)], dim=-1)

    def finish(self, attn_BhSd: torch.Tensor, hidden_BSH: torch.Tensor) -> torch.Tensor:
        """Layer output `[B, S, H]` from the attention output `[B, h, S, dv]` (before `o_proj`)."""
        B, h, S, d = attn_BhSd.shape
        residual = hidden_BSH + self.self_attn.o_proj(attn_BhSd.transpose(1, 2).reshape(B, S, h * d))
        return residual + self.mlp(self.post_attention_layernorm(residual))


class Eagle3Drafter(nn.Module):
    """EAGLE-3 drafter. `embed_tokens` is the target's, frozen; everything else trains."""

    # Buffers (`register_buffer`), declared so that attribute access types as a tensor, not `Tensor | Module`.
    d2t: torch.Tensor
    t2d: torch.Tensor

    def __init__(self, spec: Eagle3Spec) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        if spec.fc_norm:
            self.fc_norm = nn.ModuleList(
                RMSNorm(spec.target_hidden_size, spec.rms_norm_eps) for _ in range(spec.num_taps)
            )
        self.fc = nn.Linear(spec.num_taps * spec.target_hidden_size, spec.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(spec)
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = OutputHead(spec.hidden_size, spec.draft_vocab_size)
        self.register_buffer("d2t", torch.zeros(spec.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(spec.vocab_size, dtype=torch.bool))

    def fuse(self, taps_BSNHt: torch.Tensor) -> torch.Tensor:
        """`fc(cat(taps))` `[B, S, H]` from features `[B, S, N*Ht]`."""
        if self.spec.fc_norm:
            taps_BSNHt = multi_rms_norm(self.fc_norm, taps_BSNHt)
        return self.fc(taps_BSNHt)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention's RoPE tables `[..., d_rope]` (head_dim for GQA, qk_rope_head_dim for MLA)."""
        return self.midlayer.self_attn.rope(positions)

    def head(self, h_out_BSH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft logits `[B, S, Vd]` and the hidden state passed to the next depth."""
        normed = self.norm(h_out_BSH)
        return self.lm_head(normed), normed if self.spec.norm_output else h_out_BSH

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def logits(self, hidden_BSH: torch.Tensor) -> torch.Tensor:
        """Draft logits `[..., Vd]` from the layer output `[..., H]`."""
        return self.lm_head(self.norm(hidden_BSH))

    def ttt_forward(self, input_ids_BS: torch.Tensor, features_BSF: torch.Tensor, depth: int) -> list[torch.Tensor]:
        """Draft logits `[B, S, Vd]` for each depth 0..depth-1 (see `ttt_hidden`)."""
        return [self.logits(h) for h in self.ttt_hidden(input_ids_BS, features_BSF, depth)]

    def ttt_hidden(self, input_ids_BS: torch.Tensor, features_BSF: torch.Tensor, depth: int) -> list[torch.Tensor]:
        """Training-time test: the layer output `[B, S, H]` (before norm and lm_head) for each depth.

        Position t carries target feature f_t and the embedding of token t+1 + k at depth k, at RoPE
        position t + k. Depth k's query at t attends to depth-0 keys at positions <= t and to the key
        at t of every depth 1..k: exactly the keys an inference-time chain sees.
        """
        B, S = input_ids_BS.shape
        hidden = self.fuse(features_BSF)
        attn = self.midlayer.self_attn
        base_k: torch.Tensor | None = None
        base_v: torch.Tensor | None = None
        diag_k: list[torch.Tensor] = []
        diag_v: list[torch.Tensor] = []
        outputs = []
        for k in range(depth):
            tokens = shift_left(input_ids_BS, 1 + k)
            x = self.midlayer.attn_input(self.embed_tokens(tokens), hidden)
            q, kk, vv = attn.qkv(x, torch.arange(S, device=input_ids_BS.device) + k)
            if base_k is None or base_v is None:
                base_k, base_v = kk, vv
            else:
                diag_k.append(kk)
                diag_v.append(vv)
            out = chain_attention(q, base_k, base_v, diag_k, diag_v, attn.scale)
            h_out = self.midlayer.finish(out, hidden)
            outputs.append(h_out)
            hidden = self.norm(h_out) if self.spec.norm_output else h_out
        return outputs


def shift_left(x: torch.Tensor, n: int, fill: int | float = 0) -> torch.Tensor:
    """`x[:, n:]` padded back to length S with `fill` (dim 1)."""
    if n == 0:
        return x
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], dim=1)
