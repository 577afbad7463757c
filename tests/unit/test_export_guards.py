"""Every export guard fires on a deliberately broken export, naming what is wrong; engine conventions hold."""

import json

import pytest
import torch

from draftsmith.core import tensorio
from draftsmith.drafters import vocab
from draftsmith.drafters.eagle3.model import Eagle3Drafter, Eagle3Spec
from draftsmith.drafters.export import bundle, engines
from draftsmith.drafters.export.guards import ExportError

pytestmark = pytest.mark.unit

TAPS = [1, 3, 5]
LAYERS = 6
V, VD = 80, 24


def _drafter(seed: int = 0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    spec = Eagle3Spec(
        hidden_size=32, target_hidden_size=24, num_taps=3, num_heads=4, num_kv_heads=2, head_dim=8,
        intermediate_size=48, vocab_size=V, draft_vocab_size=VD, fc_norm=True, norm_output=True,
    )  # fmt: skip
    model = Eagle3Drafter(spec).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    d2t, t2d = vocab.build_draft_vocab(torch.randint(0, 50, (V,)), VD)
    model.d2t.copy_(d2t)
    model.t2d.copy_(t2d)
    return model


@pytest.fixture
def model():
    return _drafter()


def _export(model: Eagle3Drafter, engine: str = "vllm") -> dict[str, bytes]:
    embed = model.embed_tokens.weight.detach().clone()
    return bundle.export_drafter(
        "eagle3", model, TAPS, {"target": "t"}, engine=engine, num_target_layers=LAYERS, target_embed_VH=embed
    )


def _export_against(model: Eagle3Drafter, target_embed: torch.Tensor) -> dict[str, bytes]:
    return bundle.export_drafter(
        "eagle3", model, TAPS, {}, engine="vllm", num_target_layers=LAYERS, target_embed_VH=target_embed
    )


def _verify(blobs: dict[str, bytes], engine: str = "vllm", taps=TAPS, embed=None) -> None:
    bundle.verify_blobs("eagle3", engine, blobs, taps=taps, num_target_layers=LAYERS, target_embed_VH=embed)


def _edit_tensors(blobs: dict[str, bytes], edit) -> dict[str, bytes]:
    tensors, _ = tensorio.loads(blobs["model.safetensors"])
    edit(tensors)
    return blobs | {"model.safetensors": tensorio.dumps(tensors)}


def _edit_config(blobs: dict[str, bytes], edit) -> dict[str, bytes]:
    config = json.loads(blobs["config.json"])
    edit(config)
    return blobs | {"config.json": json.dumps(config).encode()}


def test_a_correct_export_passes_every_engine(model):
    for engine in engines.ENGINES:
        _verify(_export(model, engine), engine)


def test_missing_key(model):
    broken = _edit_tensors(_export(model), lambda t: t.pop("midlayer.hidden_norm.weight"))
    with pytest.raises(ExportError, match=r"missing key\(s\) \['midlayer.hidden_norm.weight'\]"):
        _verify(broken)


def test_unexpected_key(model):
    broken = _edit_tensors(_export(model), lambda t: t.update({"layers.0.mlp.gate_proj.weight": torch.ones(2)}))
    with pytest.raises(ExportError, match=r"unexpected key\(s\) \['layers.0.mlp.gate_proj.weight'\]"):
        _verify(broken)


def test_misshaped_key_against_the_config(model):
    blobs = _export(model)
    broken = _edit_tensors(blobs, lambda t: t.update({"lm_head.weight": t["lm_head.weight"][:-1]}))
    with pytest.raises(ExportError, match=r"'lm_head.weight' has shape \[23, 32\], the config implies \[24, 32\]"):
        _verify(broken)
    # The config is the reference: a config that lies about the width breaks every projection.
    lying = _edit_config(blobs, lambda c: c.update({"intermediate_size": 64}))
    with pytest.raises(ExportError, match="midlayer.mlp"):
        _verify(lying)


def test_weights_not_in_bf16(model):
    broken = _edit_tensors(_export(model), lambda t: t.update({"norm.weight": t["norm.weight"].float()}))
    with pytest.raises(ExportError, match="'norm.weight' is torch.float32"):
        _verify(broken)


def test_nan_weight(model):
    def poison(t):
        t["fc.weight"][0, 0] = float("nan")

    with pytest.raises(ExportError, match="'fc.weight' holds NaN"):
        _verify(_edit_tensors(_export(model), poison))


def test_d2t_inconsistent_with_t2d(model):
    def drop_one(t):
        t2d = t["t2d"].clone()
        t2d[int(torch.nonzero(t2d)[0])] = False
        t2d[int(torch.nonzero(~t2d)[-1])] = True  # same count, different set
        t["t2d"] = t2d

    with pytest.raises(ExportError, match="'d2t' is inconsistent with 't2d'"):
        _verify(_edit_tensors(_export(model), drop_one))
    with pytest.raises(ExportError, match="'d2t' must be int64"):
        _verify(_edit_tensors(_export(model), lambda t: t.update({"d2t": t["d2t"].int()})))


def test_aux_ids_in_the_wrong_engine_convention(model):
    vllm_blobs = _export(model, "vllm")
    # A vLLM export handed to an SGLang-native loader: ids must be taps - 1 there.
    with pytest.raises(ExportError, match=r"\[1, 3, 5\] but taps \[1, 3, 5\] are \[0, 2, 4\] for eagle3 on sglang"):
        _verify(vllm_blobs, "sglang")
    with pytest.raises(ExportError, match=r"are \[1, 3, 5\] for eagle3 on vllm"):
        _verify(_export(model, "sglang"), "vllm")
    nested = _edit_config(vllm_blobs, lambda c: c["eagle_config"].update({"eagle_aux_hidden_state_layer_ids": [0]}))
    with pytest.raises(ExportError, match="eagle_config"):
        _verify(nested)


def test_aux_ids_out_of_range(model):
    with pytest.raises(ExportError, match=r"tap 7 is outside the target's layers 1..6"):
        bundle.export_drafter(
            "eagle3", model, [1, 3, 7], {}, engine="vllm", num_target_layers=LAYERS, target_embed_VH=None
        )


def test_embedding_never_copied(model):
    target = model.embed_tokens.weight.detach().clone()
    with torch.no_grad():
        model.embed_tokens.weight.zero_()
    with pytest.raises(ExportError, match=r"embed_tokens.weight: the embedding is constant \(0.0\)"):
        _export_against(model, target)


def test_embedding_differs_from_the_target(model):
    other = _drafter(seed=1).embed_tokens.weight.detach()
    with pytest.raises(ExportError, match="differs from the target's input embedding"):
        _export_against(model, other)


def test_shipped_embedding_is_checked(model, monkeypatch):
    # An engine file that carries its own embed_tokens must carry the target's, not a zero placeholder.
    blobs = _export(model)
    module = bundle.method_module("eagle3")
    shapes = module.expected_shapes
    monkeypatch.setattr(module, "expected_shapes", lambda config: shapes(config) | {"embed_tokens.weight": (V, 32)})
    zero = _edit_tensors(blobs, lambda t: t.update({"embed_tokens.weight": torch.zeros(V, 32, dtype=torch.bfloat16)}))
    with pytest.raises(ExportError, match="embed_tokens.weight: the embedding is constant"):
        _verify(zero)
    target = model.embed_tokens.weight.detach()
    shipped = _edit_tensors(blobs, lambda t: t.update({"embed_tokens.weight": target.to(torch.bfloat16)}))
    _verify(shipped, embed=target)  # the bf16 copy of the target's embedding passes
    with pytest.raises(ExportError, match="differs from the target's"):
        _verify(shipped, embed=_drafter(seed=1).embed_tokens.weight.detach())


def test_missing_config_file(model):
    blobs = _export(model)
    blobs.pop("config.json")
    with pytest.raises(ExportError, match="config.json: missing"):
        _verify(blobs)


def test_engine_conventions():
    kimi = [2, 46, 90]
    assert engines.aux_layer_ids("eagle3", "vllm", kimi) == kimi
    assert engines.aux_layer_ids("eagle3", "tokenspeed", kimi) == kimi
    assert engines.aux_layer_ids("eagle3", "sglang", kimi) == [1, 45, 89]
    for engine in engines.ENGINES:
        assert engines.aux_layer_ids("dflash", engine, kimi) == [1, 45, 89]
        assert engines.aux_layer_ids("dspark", engine, kimi) == [1, 45, 89]
    assert engines.num_speculative_tokens("eagle3", depth=3) == 3
    assert engines.num_speculative_tokens("dflash", block_size=8) == 7
    assert engines.num_speculative_tokens("dspark", block_size=8) == 8
    with pytest.raises(ValueError, match="engine 'trtllm'"):
        engines.aux_layer_ids("eagle3", "trtllm", kimi)


def test_launch_commands():
    vllm = engines.launch_command("eagle3", "vllm", "/t", "/d", 3)
    assert vllm.startswith("vllm serve /t --host 127.0.0.1 --speculative-config ")
    assert json.loads(vllm.split("--speculative-config ")[1].strip("'")) == {
        "method": "eagle3", "model": "/d", "num_speculative_tokens": 3,
    }  # fmt: skip
    sgl = engines.launch_command("eagle3", "sglang", "/t", "/d", 3)
    assert "sglang.launch_server --model-path /t" in sgl and "--speculative-algorithm EAGLE3" in sgl
    assert "--speculative-num-steps 3" in sgl and "--speculative-num-draft-tokens 4" in sgl
    ts = engines.launch_command("dflash", "tokenspeed", "/t", "/d", 7)
    assert ts.startswith("tokenspeed serve /t") and "--speculative-algorithm DFLASH" in ts
    assert "--speculative-dspark-block-size 8" in engines.launch_command("dspark", "sglang", "/t", "/d", 8)


def test_write_folder_is_atomic_and_replaces(tmp_path):
    out = tmp_path / "export" / "vllm"
    bundle.write_folder(out, {"a.json": b"1", "stale.bin": b"x"})
    bundle.write_folder(out, {"a.json": b"2"})
    assert sorted(p.name for p in out.iterdir()) == ["a.json"]
    assert (out / "a.json").read_bytes() == b"2"
    assert sorted(p.name for p in out.parent.iterdir()) == ["vllm"]  # no temp or old folder left behind


def _dflash_model(**kw):
    from draftsmith.drafters.dflash import DFlashDrafter, DFlashSpec

    spec = DFlashSpec(
        hidden_size=32, target_hidden_size=24, num_taps=3, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
        intermediate_size=48, vocab_size=V, block_size=4, **kw,
    )  # fmt: skip
    torch.manual_seed(0)
    model = DFlashDrafter(spec)
    with torch.no_grad():
        model.embed_tokens.weight.normal_()
    return model


def _dflash_export(model, engine: str = "vllm") -> dict[str, bytes]:
    return bundle.export_drafter(
        "dflash", model, TAPS, {}, engine=engine, num_target_layers=LAYERS, target_embed_VH=None
    )


def test_dflash_layer_ids_are_taps_minus_one_everywhere():
    blobs = _dflash_export(_dflash_model())
    for engine in engines.ENGINES:
        bundle.verify_blobs("dflash", engine, blobs, taps=TAPS, num_target_layers=LAYERS)
    as_eagle = _edit_config(blobs, lambda c: c["dflash_config"].update({"target_layer_ids": TAPS}))
    with pytest.raises(ExportError, match=r"layer ids: \[1, 3, 5\] but taps \[1, 3, 5\] are \[0, 2, 4\] for dflash"):
        bundle.verify_blobs("dflash", "vllm", as_eagle, taps=TAPS, num_target_layers=LAYERS)


def test_dflash2_keys_follow_the_config():
    model = _dflash_model(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)
    blobs = _dflash_export(model)
    no_selector = _edit_tensors(blobs, lambda t: t.pop("candidate_selector.successor_codebook"))
    with pytest.raises(ExportError, match=r"missing key\(s\) \['candidate_selector.successor_codebook'\]"):
        bundle.verify_blobs("dflash", "vllm", no_selector, taps=TAPS, num_target_layers=LAYERS)
    wider = _edit_config(blobs, lambda c: c["dflash_config"].update({"conv_kernel_size": 3}))
    with pytest.raises(ExportError, match=r"'layers.0.attention_conv.base_kernel' has shape \[2, 2, 32\]"):
        bundle.verify_blobs("dflash", "vllm", wider, taps=TAPS, num_target_layers=LAYERS)


def test_dflash_variants_no_engine_serves_are_refused():
    with pytest.raises(ExportError, match="DFlash2DraftModel builds both the conv and the candidate selector"):
        _dflash_export(_dflash_model(conv_kernel_size=2, conv_group_size=16))
    with pytest.raises(ExportError, match="vLLM's qwen3_dflash has no fc_norm"):
        _dflash_export(_dflash_model(fc_norm=True))
    _dflash_export(_dflash_model(fc_norm=True), engine="sglang")  # not refused where the loader is unknown


def test_dspark_guards():
    from draftsmith.drafters.dspark.model import DSparkDrafter, DSparkSpec

    spec = DSparkSpec(
        hidden_size=32, target_hidden_size=24, num_taps=3, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
        intermediate_size=48, vocab_size=V, block_size=4, markov_rank=6,
    )  # fmt: skip
    model = DSparkDrafter(spec)
    with torch.no_grad():
        model.embed_tokens.weight.normal_()
    blobs = bundle.export_drafter(
        "dspark", model, TAPS, {}, engine="sglang", num_target_layers=LAYERS, target_embed_VH=None
    )
    split = _edit_config(blobs, lambda c: c["dflash_config"].update({"target_layer_ids": [1, 3, 5]}))
    with pytest.raises(ExportError, match=r"target_layer_ids \[0, 2, 4\] != dflash_config.target_layer_ids"):
        bundle.verify_blobs("dspark", "sglang", split, taps=TAPS, num_target_layers=LAYERS)
    no_conf = _edit_config(blobs, lambda c: c.update({"enable_confidence_head": False}))
    with pytest.raises(
        ExportError, match=r"unexpected key\(s\) \['confidence_head.proj.bias', 'confidence_head.proj.weight'\]"
    ):
        bundle.verify_blobs("dspark", "sglang", no_conf, taps=TAPS, num_target_layers=LAYERS)
    rank = _edit_config(blobs, lambda c: c.update({"markov_rank": 7}))
    with pytest.raises(
        ExportError, match=r"'markov_head.markov_w1.weight' has shape \[80, 6\], the config implies \[80, 7\]"
    ):
        bundle.verify_blobs("dspark", "sglang", rank, taps=TAPS, num_target_layers=LAYERS)


def test_full_vocabulary_d2t_is_refused():
    torch.manual_seed(0)
    spec = Eagle3Spec(
        hidden_size=32, target_hidden_size=24, num_taps=3, num_heads=4, num_kv_heads=2, head_dim=8,
        intermediate_size=48, vocab_size=V, draft_vocab_size=V,
    )  # fmt: skip
    model = Eagle3Drafter(spec)
    with torch.no_grad():
        model.embed_tokens.weight.normal_()
    model.t2d.fill_(True)
    blobs = bundle.export_drafter(
        "eagle3", model, TAPS, {}, engine="vllm", num_target_layers=LAYERS, target_embed_VH=None
    )
    with_d2t = _edit_tensors(
        blobs, lambda t: t.update({"d2t": torch.zeros(V, dtype=torch.int64), "t2d": torch.ones(V, dtype=torch.bool)})
    )
    with pytest.raises(ExportError, match=r"unexpected key\(s\) \['d2t', 't2d'\]"):
        _verify(with_d2t)
