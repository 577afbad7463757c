"""A drafter that starts from a target layer gets that layer from the safetensors alone, on real and meta builds."""

import pytest
import torch

from draftsmith.core.config import Eagle3Config
from draftsmith.drafters import families
from draftsmith.drafters.training.target_parts import load_target_parts

pytestmark = pytest.mark.integration


def _cfg(target_config) -> Eagle3Config:
    c = target_config
    return Eagle3Config(
        draft_vocab_size=64,
        num_heads=c.num_attention_heads,
        num_kv_heads=c.num_key_value_heads,
        head_dim=c.hidden_size // c.num_attention_heads,
        intermediate_size=c.intermediate_size,
        fc_norm=True,
        init_layer_from_target=-1,
        init_fc_last_tap=True,
    )


def test_the_layer_is_read_and_copied_and_the_meta_build_still_works(tiny_cfg, tiny_target):
    hf, _ = tiny_target
    cfg = _cfg(hf.config)
    n = hf.config.num_hidden_layers
    assert cfg.target_modules(n) == [f"model.layers.{n - 1}", "model.norm"]
    parts = load_target_parts(tiny_cfg.target, materialize=True, modules=cfg.target_modules(n))
    want = hf.model.layers[n - 1].mlp.down_proj.weight.float()
    assert torch.equal(parts.model.layers[n - 1].mlp.down_proj.weight, want)
    assert parts.model.layers[0].mlp.down_proj.weight.is_meta  # only what the drafter reads is loaded
    counts = torch.ones(hf.config.vocab_size, dtype=torch.long)
    drafter = families.family("eagle3").build(cfg, families.BuildInputs(tiny_cfg.target, parts, 3, counts))
    assert torch.equal(drafter.get_parameter("midlayer.mlp.down_proj.weight"), want)
    assert torch.equal(drafter.get_parameter("norm.weight"), hf.model.norm.weight.float())
    skeleton = load_target_parts(tiny_cfg.target, materialize=False)
    with torch.device("meta"):  # as the trainer's worker builds the skeleton every rank shards
        counts_meta = torch.zeros(hf.config.vocab_size, dtype=torch.long)
        meta = families.family("eagle3").build(cfg, families.BuildInputs(tiny_cfg.target, skeleton, 3, counts_meta))
    assert meta.get_parameter("midlayer.mlp.down_proj.weight").is_meta
