"""MLA against transformers' DeepSeek-V3 attention with the same weights (plain RoPE and YaRN)."""

import pytest
import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

from draftsmith.drafters import masks
from draftsmith.drafters.mla import MLASpec, MLAttention

pytestmark = pytest.mark.unit

YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


@pytest.mark.parametrize("rope", [{"rope_type": "default", "rope_theta": 10000.0}, YARN], ids=["plain", "yarn"])
@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_mla_equals_deepseek_v3_attention(rope, q_lora_rank):
    torch.manual_seed(0)
    config = DeepseekV3Config(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=12,
        rope_interleave=False,
        rope_parameters=rope,
        max_position_embeddings=512,
        attention_bias=False,
    )
    config._attn_implementation = "eager"
    ref = DeepseekV3Attention(config, layer_idx=0).eval()
    for p in ref.parameters():  # RMSNorm weights start at one; make them count
        torch.nn.init.normal_(p, std=0.2)
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"} if rope["rope_type"] == "yarn" else None
    spec = MLASpec(64, 4, 16, 8, 8, 12, q_lora_rank=q_lora_rank, rms_norm_eps=config.rms_norm_eps, rope_scaling=scaling)
    ours = MLAttention(spec).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)  # same parameter names, same shapes

    B, S = 2, 40
    x = torch.randn(B, S, 64)
    positions = torch.arange(100, 100 + S)  # past original_max_position_embeddings: YaRN matters
    doc = torch.tensor([[0] * 25 + [1] * 15, [0] * S])
    allowed = masks.dense(masks.doc_causal(doc), B, S, S)
    cos, sin = DeepseekV3RotaryEmbedding(config)(x, positions[None].expand(B, S))
    additive = torch.zeros(B, 1, S, S).masked_fill(~allowed, torch.finfo(torch.float32).min)
    with torch.no_grad():
        want, _ = ref(x, position_embeddings=(cos, sin), attention_mask=additive)
        got = ours(x, positions, allowed)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
