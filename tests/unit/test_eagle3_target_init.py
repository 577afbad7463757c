"""Starting the EAGLE-3 draft layer from a target decoder layer (`drafter.init_layer_from_target`)."""

import math

import pytest
import torch
from pydantic import ValidationError

from draftsmith.core.config import Eagle3Config
from draftsmith.drafters.eagle3.model import Eagle3Drafter, Eagle3Spec
from draftsmith.drafters.eagle3.target_init import init_from_target_layer
from tests.support.kernels import Tol
from tests.support.models import small_llama

pytestmark = pytest.mark.unit

H = 24


def _drafter(**kw) -> Eagle3Drafter:
    spec = dict(hidden_size=H, target_hidden_size=H, num_taps=3, num_heads=4, num_kv_heads=2, head_dim=6,
                intermediate_size=48, vocab_size=12, draft_vocab_size=8, fc_norm=True)  # fmt: skip
    torch.manual_seed(1)
    return Eagle3Drafter(Eagle3Spec(**(spec | kw)))


def test_the_layer_computes_the_target_layer_on_the_sum_of_its_two_inputs():
    target, drafter = small_llama(), _drafter()
    init_from_target_layer(drafter, target, -1, fc_last_tap=False)
    src, dst = target.model.layers[-1], drafter.midlayer
    a, b = torch.randn(5, H), torch.randn(5, H)
    for proj in ("q_proj", "k_proj", "v_proj"):
        got = getattr(dst.self_attn, proj)(torch.cat([a, b], -1))
        want = getattr(src.self_attn, proj)(a + b) / math.sqrt(2)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    x = torch.randn(5, H)
    torch.testing.assert_close(dst.mlp(x), src.mlp(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dst.self_attn.o_proj(x), src.self_attn.o_proj(x))
    close: Tol = {"rtol": 1e-4, "atol": 1e-4}  # the drafter's norms keep their own eps
    want_in = src.input_layernorm(x)
    torch.testing.assert_close(dst.input_layernorm(x), want_in, **close)
    torch.testing.assert_close(dst.hidden_norm(x), want_in, **close)
    torch.testing.assert_close(dst.post_attention_layernorm(x), src.post_attention_layernorm(x), **close)
    torch.testing.assert_close(drafter.norm(x), target.model.norm(x), **close)


def test_fc_last_tap_passes_the_last_tap_through_its_norm():
    target, drafter = small_llama(), _drafter()
    before = drafter.fc.weight.clone()
    init_from_target_layer(drafter, target, 0, fc_last_tap=False)
    assert torch.equal(drafter.fc.weight, before)  # without the switch the fusion stays random
    init_from_target_layer(drafter, target, 0, fc_last_tap=True)
    taps = torch.randn(2, 3, 3 * H) * 50
    want = drafter.fc_norm[2](taps[..., 2 * H :])
    torch.testing.assert_close(drafter.fuse(taps), want, rtol=1e-5, atol=1e-5)


def test_a_missing_layer_or_other_shapes_name_the_field():
    target = small_llama()
    with pytest.raises(ValueError, match=r"drafter.init_layer_from_target: 4 is not a layer of the 4-layer target"):
        init_from_target_layer(_drafter(), target, 4, fc_last_tap=False)
    with pytest.raises(ValueError, match=r"drafter.init_layer_from_target: mlp.gate_proj is \(48, 24\) in the target"):
        init_from_target_layer(_drafter(intermediate_size=32), target, -1, fc_last_tap=False)


def test_the_recipe_fields_are_checked_together():
    base = dict(draft_vocab_size=8, num_heads=4, num_kv_heads=2, head_dim=6, intermediate_size=48)
    assert Eagle3Config(**base).init_layer_from_target is None  # the default: a random layer
    with pytest.raises(ValidationError, match="init_fc_last_tap: needs init_layer_from_target"):
        Eagle3Config(**base, init_fc_last_tap=True)
    mla = {"kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 2, "v_head_dim": 4}
    with pytest.raises(ValidationError, match="init_layer_from_target: only GQA"):
        Eagle3Config(**base, attention="mla", mla=mla, init_layer_from_target=-1)
