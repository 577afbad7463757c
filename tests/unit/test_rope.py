"""Drafter RoPE tables against transformers' reference implementations (plain and YaRN)."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from draftsmith.drafters.layers import RopeScaling, rope_tables

pytestmark = pytest.mark.unit


def _reference(params: dict, head_dim: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, rope_parameters=params)
    kind = params["rope_type"]
    inv_freq, att = ROPE_INIT_FUNCTIONS[kind](config, "cpu") if kind != "default" else (None, 1.0)
    if inv_freq is None:
        inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim))
    emb = torch.cat([positions.float()[:, None] * inv_freq] * 2, dim=-1)
    return emb.cos() * att, emb.sin() * att


CASES = [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0, "original_max_position_embeddings": 2048},
    # DeepSeek-V3 / Kimi style: mscale and mscale_all_dim, a large factor, beta bounds spelled out.
    {
        "rope_type": "yarn",
        "rope_theta": 50000.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    {"rope_type": "yarn", "rope_theta": 1e6, "factor": 8.0, "original_max_position_embeddings": 8192, "mscale": 0.707},
]


@pytest.mark.parametrize("params", CASES, ids=["default", "yarn", "yarn-deepseek", "yarn-mscale"])
def test_rope_tables_match_transformers(params):
    head_dim = 64
    positions = torch.tensor([0, 1, 7, 100, 2047, 5000, 65_000])
    cos, sin = rope_tables(positions, head_dim, params["rope_theta"], RopeScaling.from_config(params))
    ref_cos, ref_sin = _reference(params, head_dim, positions)
    torch.testing.assert_close(cos, ref_cos, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin, ref_sin, rtol=1e-5, atol=1e-5)


def test_yarn_changes_only_low_frequencies_and_unknown_types_fail():
    plain = rope_tables(torch.tensor([3000]), 64, 50000.0)
    yarn = rope_tables(
        torch.tensor([3000]),
        64,
        50000.0,
        RopeScaling(rope_type="yarn", factor=4.0, original_max_position_embeddings=2048, attention_factor=1.0),
    )
    assert torch.equal(plain[0][0, :4], yarn[0][0, :4])  # the fastest dims extrapolate unchanged
    assert not torch.allclose(plain[0][0, 28:32], yarn[0][0, 28:32])  # the slowest are interpolated
    with pytest.raises(ValueError, match="rope_parameters.rope_type: 'linear' is not supported"):
        RopeScaling.from_config({"rope_type": "linear", "factor": 2.0})
    with pytest.raises(ValueError, match="original_max_position_embeddings: required"):
        rope_tables(torch.tensor([1]), 64, 1e4, RopeScaling(rope_type="yarn", factor=2.0))


def test_an_eagle3_drafter_rotates_like_its_yarn_target_and_exports_the_scaling():
    from draftsmith.drafters.eagle3.export import serving_config
    from draftsmith.drafters.eagle3.model import Eagle3Drafter, Eagle3Spec

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}
    spec = Eagle3Spec(
        hidden_size=64,
        target_hidden_size=64,
        num_taps=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=100,
        draft_vocab_size=50,
        rope_theta=50000.0,
        rope_scaling=yarn,
    )
    positions = torch.arange(0, 6000, 997)
    got = Eagle3Drafter(spec).rope(positions)
    ref = _reference(yarn | {"rope_theta": 50000.0}, 16, positions)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)
    assert serving_config(spec, [1, 2, 3], {})["rope_scaling"] == yarn
