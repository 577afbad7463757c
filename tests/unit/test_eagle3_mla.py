"""EAGLE-3 with MLA attention: vLLM/HF layout, dense TTT == chain decoding, anchored == dense, lossless decoding."""

import pytest
import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

from draftsmith.drafters.anchors import strided_anchors
from draftsmith.drafters.eagle3.anchored import anchored_hidden, anchored_loss
from draftsmith.drafters.eagle3.attention import serving_fields
from draftsmith.drafters.eagle3.decode import greedy_generate, speculative_generate
from draftsmith.drafters.eagle3.loss import position_mask, ttt_loss
from draftsmith.drafters.eagle3.model import Eagle3Drafter
from tests.support.models import MLA_FIELDS as MLA
from tests.support.models import MLA_H as H
from tests.support.models import MLA_HT as HT
from tests.support.models import MLA_TAPS as TAPS
from tests.support.models import MLA_V as V
from tests.support.models import check_chain_matches_ttt, eagle3_mla_drafter, eagle3_mla_spec, small_llama

pytestmark = pytest.mark.unit

# DeepSeek-style YaRN: mscale_all_dim also scales the softmax, so a path that ignores `attn.scale` fails.
YARN = {
    "rope_type": "yarn",
    "factor": 8.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def test_spec_rejects_inconsistent_attention_fields():
    with pytest.raises(ValueError, match=r"Eagle3Spec\.mla: required"):
        eagle3_mla_spec(mla=None)
    with pytest.raises(ValueError, match=r"Eagle3Spec\.mla: given but attention is 'gqa'"):
        eagle3_mla_spec(attention="gqa")
    with pytest.raises(ValueError, match=r"unknown keys \['rank'\], missing keys \['kv_lora_rank'\]"):
        eagle3_mla_spec(mla={k: v for k, v in MLA.items() if k != "kv_lora_rank"} | {"rank": 4})
    with pytest.raises(ValueError, match=r"Eagle3Spec\.attention: 'mha'"):
        eagle3_mla_spec(attention="mha")
    assert (
        serving_fields(eagle3_mla_spec(attention="gqa", mla=None)) == {}
    )  # the Llama EAGLE-3 config needs nothing more


def test_parameter_names_and_widths_are_what_vllm_deepseek_eagle3_loads():
    shapes = {
        k: tuple(v.shape) for k, v in Eagle3Drafter(eagle3_mla_spec(mla=MLA | {"q_lora_rank": 20})).state_dict().items()
    }
    attn = {k.removeprefix("midlayer.self_attn."): v for k, v in shapes.items() if "self_attn" in k}
    assert attn == {
        "q_a_proj.weight": (20, 2 * H),  # input_size = 2H in DeepseekV2Eagle3DecoderLayer
        "q_a_layernorm.weight": (20,),
        "q_b_proj.weight": (4 * 16, 20),
        "kv_a_proj_with_mqa.weight": (12 + 8, 2 * H),
        "kv_a_layernorm.weight": (12,),
        "kv_b_proj.weight": (4 * (8 + 12), 12),
        "o_proj.weight": (H, 4 * 12),
    }
    plain = Eagle3Drafter(eagle3_mla_spec()).state_dict()
    assert plain["midlayer.self_attn.q_proj.weight"].shape == (4 * 16, 2 * H)


@pytest.mark.parametrize(("rope", "q_lora_rank"), [(None, None), (YARN, 20)], ids=["plain", "yarn-qlora"])
def test_mla_layer_equals_hf_deepseek_v3_from_serving_fields(rope, q_lora_rank):
    """Our interleaved-RoPE MLA == HF DeepseekV3Attention configured from `serving_fields` (rope_interleave)."""
    spec = eagle3_mla_spec(mla=MLA | {"q_lora_rank": q_lora_rank}, rope_scaling=rope, rope_theta=500.0)
    ours = eagle3_mla_drafter(spec).midlayer.self_attn
    fields = serving_fields(spec)
    assert fields["architectures"] == ["Eagle3DeepseekV3ForCausalLM"] and fields["rope_interleave"] is True
    cfg_fields = {k: v for k, v in fields.items() if k not in ("architectures", "model_type", "norm_before_residual")}
    # vLLM builds the layer with hidden_size H and input_size 2H; HF has one width, so give it 2H and
    # compare the first H outputs of an o_proj padded with zero rows.
    config = DeepseekV3Config(**(cfg_fields | {"hidden_size": 2 * H, "max_position_embeddings": 512}))
    config._attn_implementation = "eager"
    ref = DeepseekV3Attention(config, layer_idx=0).eval()
    state = dict(ours.state_dict())
    state["o_proj.weight"] = torch.cat([state["o_proj.weight"], torch.zeros_like(state["o_proj.weight"])])
    ref.load_state_dict(state, strict=True)

    B, S = 2, 24
    x = torch.randn(B, S, 2 * H)
    positions = torch.arange(40, 40 + S)  # beyond original_max_position_embeddings: YaRN matters
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    cos, sin = DeepseekV3RotaryEmbedding(config)(x, positions[None].expand(B, S))
    additive = torch.zeros(B, 1, S, S).masked_fill(~causal, torch.finfo(torch.float32).min)
    with torch.no_grad():
        want, _ = ref(x, position_embeddings=(cos, sin), attention_mask=additive)
        got = ours(x, positions, causal[None, None].expand(B, 1, S, S))
    torch.testing.assert_close(got, want[..., :H], rtol=1e-4, atol=1e-5)
    assert ours.scale == pytest.approx(ref.scaling)


def test_interleaved_rope_pairs_adjacent_dims():
    """Rotating position p by p' equals position p + p' on pairs (2i, 2i+1), not on (i, i + d/2)."""
    attn = eagle3_mla_drafter(eagle3_mla_spec()).midlayer.self_attn
    x = torch.randn(1, 1, 2 * H).expand(1, 3, 2 * H)
    q, k, _ = attn.qkv(x, torch.tensor([0, 3, 7]))
    dn = MLA["qk_nope_head_dim"]
    q0 = q[0, :, 0, dn:]  # position 0: unrotated, de-interleaved order
    raw = attn.q_proj(x[:, :1]).view(4, 16)[:, dn:]  # interleaved order as stored
    torch.testing.assert_close(q0, torch.cat([raw[:, 0::2], raw[:, 1::2]], dim=-1))
    # relative-position property of RoPE: <q_m, k_n> depends on n - m only (same content vector)
    scores = (q[0, :, :, dn:] @ k[0, :, :, dn:].transpose(-1, -2))[0]
    q2, k2, _ = attn.qkv(x, torch.tensor([10, 13, 17]))
    torch.testing.assert_close((q2[0, :, :, dn:] @ k2[0, :, :, dn:].transpose(-1, -2))[0], scores, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("norm_output", "fc_norm", "rope", "q_lora_rank"),
    [(False, False, None, None), (True, True, YARN, 20)],
    ids=["eagle3", "eagle3.1-yarn-qlora"],
)
@torch.no_grad()
def test_mla_ttt_depths_equal_the_cached_inference_chain(norm_output, fc_norm, rope, q_lora_rank):
    """Depth k at position t == chain step k with the KV cache after a context of positions 0..t."""
    spec = eagle3_mla_spec(
        norm_output=norm_output, fc_norm=fc_norm, rope_scaling=rope, mla=MLA | {"q_lora_rank": q_lora_rank}
    )
    model = eagle3_mla_drafter(spec)
    S, depth = 22, 3  # S > original_max_position_embeddings (16) so YaRN's ramp is exercised
    ids = torch.randint(0, V, (1, S))
    feats = torch.randn(1, S, TAPS * HT)
    positions = range(0, S - depth - 1, 3)
    for t, cache in zip(positions, check_chain_matches_ttt(model, ids, feats, depth, positions), strict=True):
        assert cache.k is not None and cache.v is not None
        assert cache.k.shape == (1, 4, t + depth, 16) and cache.v.shape == (1, 4, t + depth, 12)


def test_mla_anchored_ttt_equals_dense_ttt():
    """Every position an anchor: same hidden states, loss and gradients path; sampled anchors: dense at anchors."""
    model = eagle3_mla_drafter(eagle3_mla_spec(norm_output=True, rope_scaling=YARN, mla=MLA | {"q_lora_rank": 20}))
    B, S, depth = 2, 20, 3
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (B, S), generator=g)
    feats = torch.randn(B, S, TAPS * HT, generator=g)
    loss_mask = torch.rand(B, S, generator=g) > 0.3
    last, head = torch.randn(B, S, HT, generator=g), torch.randn(V, HT, generator=g)
    mask = position_mask(loss_mask, torch.ones(B, S, dtype=torch.bool))
    dense_hidden = model.ttt_hidden(ids, feats, depth)
    dense = ttt_loss(model.logits, dense_hidden, (last[mask] @ head.T).log_softmax(-1), mask, 0.8)

    anchors, keep = torch.arange(S).expand(B, S).contiguous(), torch.ones(B, S, dtype=torch.bool)
    hidden = anchored_hidden(model, ids, feats, anchors, keep, depth)
    for d in range(depth):
        torch.testing.assert_close(hidden[d], dense_hidden[d], rtol=1e-5, atol=1e-5)
    got = anchored_loss(model, hidden, anchors, keep, last, head, mask, 0.8)
    torch.testing.assert_close(got.total, dense.total, rtol=1e-5, atol=1e-6)
    got.total.backward()
    grad = model.get_parameter("midlayer.self_attn.kv_a_proj_with_mqa.weight").grad
    assert grad is not None and grad.abs().sum() > 0

    anchors, keep = strided_anchors(loss_mask, 4, depth, max_gap=depth, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        sampled = anchored_hidden(model, ids, feats, anchors, keep, depth)
    rows = torch.arange(B)[:, None].expand_as(anchors)
    for d in range(depth):
        want = dense_hidden[d].detach()[rows[keep], anchors[keep]]
        torch.testing.assert_close(sampled[d][keep], want, rtol=1e-5, atol=1e-5)


def _tiny_target(vocab: int):
    return small_llama(vocab, HT, seed=1)


def test_speculative_decoding_with_an_mla_drafter_equals_target_greedy():
    vocab = 12  # small, so a random drafter's guesses are sometimes accepted and rollback is exercised
    target = _tiny_target(vocab)
    spec = eagle3_mla_spec(
        target_hidden_size=HT, vocab_size=vocab, draft_vocab_size=vocab, mla=MLA | {"q_lora_rank": 20}
    )
    drafter = eagle3_mla_drafter(spec, seed=3)
    with torch.no_grad():  # a stand-in for the shared frozen embedding (the drafter is H wide, the target Ht)
        drafter.embed_tokens.weight.copy_(torch.randn(vocab, H))
    g = torch.Generator().manual_seed(0)
    rounds = accepted = 0
    for _ in range(3):
        prompt = torch.randint(0, vocab, (7,), generator=g)
        base = greedy_generate(target, prompt, max_new=24, eos=set())
        got = speculative_generate(target, drafter, [1, 2, 3], prompt, g=3, max_new=24, eos=set())
        assert got.tokens == base.tokens
        rounds, accepted = rounds + got.rounds, accepted + got.accepted
    assert 0 < accepted < 3 * rounds, (accepted, rounds)  # both accepted drafts and rejections happened
