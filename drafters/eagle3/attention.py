"""The attention of the EAGLE-3 draft layer: GQA (Llama) or MLA (DeepSeek-V3 / Kimi), behind one interface.

Both read the 2H-wide `[norm(embed); norm(hidden)]` input and write back to the H-wide residual. Every
EAGLE-3 path (dense TTT, anchored TTT, decoding with a KV cache) uses only this interface, so none of them
branches on the kind:

- `qkv(x_BS2H, positions) -> q [B, h, S, dqk], k [B, h, S, dqk], v [B, h, S, dv]`: RoPE applied, kv heads
  already expanded to the query heads (`positions` `[S]` or `[B, S]`);
- `scale`: the softmax scale of `q @ k^T`;
- `o_proj`: `[B, S, h*dv] -> [B, S, H]`;
- `rope(positions) -> cos, sin` `[..., d_rope]`.

MLA layout (vLLM `deepseek_eagle3.py` → `DeepseekV2MLAAttention(input_size=2H)`): `q_proj` (or `q_a_proj`)
and `kv_a_proj_with_mqa` read the 2H input; `q_b_proj`, `kv_b_proj` read the latents; `o_proj` writes H.
RoPE: vLLM builds its rotary embedding with `is_neox_style=False`, i.e. it rotates *interleaved* pairs
`(x[2i], x[2i+1])` of the `qk_rope_head_dim` dims; HF DeepSeek-V3 does the same with `rope_interleave: true`
(its config default) by de-interleaving and then rotating halves. We use the interleaved layout because the
weights are then what vLLM loads with no permutation (export stays a dtype cast), and because DeepSeek/Kimi
target layers, a natural initialisation for the draft layer, are stored in it. (`draftsmith.drafters.mla.MLAttention`,
which this subclasses for its parameters, uses the half-split layout for block drafters.)
`tests/unit/test_eagle3_mla.py` checks the layer against HF `DeepseekV3Attention(rope_interleave=True)` built
from `serving_fields`.

Shape legend: B batch, S sequence, H drafter width, h heads, g kv heads, d head width, dn/dr/dv MLA no-RoPE,
RoPE and value head widths, dqk query/key width (d, or dn + dr).
"""

from __future__ import annotations

import torch
from torch import nn

from draftsmith.drafters.eagle3.spec import Eagle3Spec, check_attention
from draftsmith.drafters.layers import RopeScaling, apply_rope, rope_tables
from draftsmith.drafters.mla import MLASpec, MLAttention


class GQAttention(nn.Module):
    """Llama GQA with q/k/v reading the 2H input (vLLM `LlamaForCausalLMEagle3` names)."""

    def __init__(self, spec: Eagle3Spec) -> None:
        super().__init__()
        self.h, self.g, self.d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.theta, self.rope_scaling = spec.rope_theta, RopeScaling.from_config(spec.rope_scaling)
        self.scale = self.d**-0.5
        self.q_proj = nn.Linear(2 * spec.hidden_size, self.h * self.d, bias=False)
        self.k_proj = nn.Linear(2 * spec.hidden_size, self.g * self.d, bias=False)
        self.v_proj = nn.Linear(2 * spec.hidden_size, self.g * self.d, bias=False)
        self.o_proj = nn.Linear(self.h * self.d, spec.hidden_size, bias=False)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_tables(positions, self.d, self.theta, self.rope_scaling)

    def qkv(self, x_BS2H: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated `q` `[B, h, S, d]`, `k` and `v` `[B, h, S, d]` (kv heads repeated)."""
        B, S, _ = x_BS2H.shape
        cos, sin = self.rope(positions)
        q = self.q_proj(x_BS2H).view(B, S, self.h, self.d).transpose(1, 2)
        k = self.k_proj(x_BS2H).view(B, S, self.g, self.d).transpose(1, 2)
        v = self.v_proj(x_BS2H).view(B, S, self.g, self.d).transpose(1, 2)
        rep = self.h // self.g
        k = apply_rope(k, cos, sin).repeat_interleave(rep, dim=1)
        return apply_rope(q, cos, sin), k, v.repeat_interleave(rep, dim=1)


def mla_spec(spec: Eagle3Spec) -> MLASpec:
    """The MLA shapes of the draft layer: projections read the 2H-wide concatenation."""
    m = spec.mla or {}
    return MLASpec(
        hidden_size=2 * spec.hidden_size,
        num_heads=spec.num_heads,
        kv_lora_rank=m["kv_lora_rank"],
        qk_nope_head_dim=m["qk_nope_head_dim"],
        qk_rope_head_dim=m["qk_rope_head_dim"],
        v_head_dim=m["v_head_dim"],
        q_lora_rank=m.get("q_lora_rank"),
        rms_norm_eps=spec.rms_norm_eps,
        rope_theta=spec.rope_theta,
        rope_scaling=spec.rope_scaling,
        rope_interleave=True,
    )


class MLAEagle3Attention(MLAttention):
    """MLA over the 2H input with interleaved RoPE pairs (vLLM `is_neox_style=False`), output width H."""

    def __init__(self, spec: Eagle3Spec) -> None:
        super().__init__(mla_spec(spec))
        sp = self.spec
        # The parent sizes o_proj to its input width (2H); the draft layer's residual is H wide.
        self.o_proj = nn.Linear(sp.num_heads * sp.v_head_dim, spec.hidden_size, bias=False)
        self.scale = self.scaling

    def qkv(self, x_BS2H: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.project(x_BS2H, positions)


def make_attention(spec: Eagle3Spec) -> GQAttention | MLAEagle3Attention:
    check_attention(spec.attention, spec.mla)
    return MLAEagle3Attention(spec) if spec.attention == "mla" else GQAttention(spec)


def serving_fields(spec: Eagle3Spec) -> dict:
    """config.json fields that vLLM's `deepseek_eagle3` reads on top of the Llama EAGLE-3 ones ({} for GQA).

    `model_type: deepseek_v3` makes vLLM parse a `DeepseekV3Config` and treat the draft as MLA (its
    `is_deepseek_mla` list); `head_dim` must equal `qk_rope_head_dim` there, as in DeepSeek-V3 configs.
    RoPE is given as `rope_parameters` (transformers 5) with `rope_interleave: true` (see the module doc).
    """
    check_attention(spec.attention, spec.mla)
    if spec.attention == "gqa":
        return {}
    m = spec.mla or {}
    scaling = dict(spec.rope_scaling or {})
    kind = scaling.pop("rope_type", scaling.pop("type", "default"))
    rope = {"rope_type": kind, **scaling, "rope_theta": spec.rope_theta}
    return {
        "architectures": ["Eagle3DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_heads,
        "head_dim": m["qk_rope_head_dim"],
        "q_lora_rank": m.get("q_lora_rank"),
        "kv_lora_rank": m["kv_lora_rank"],
        "qk_nope_head_dim": m["qk_nope_head_dim"],
        "qk_rope_head_dim": m["qk_rope_head_dim"],
        "v_head_dim": m["v_head_dim"],
        "rope_interleave": True,
        "rope_theta": spec.rope_theta,
        "rope_parameters": rope,
        **({"rope_scaling": dict(spec.rope_scaling)} if spec.rope_scaling else {}),
        "norm_before_residual": False,
    }
