"""Export, load back, identical logits; and `draftsmith export` on a run folder of the tiny target."""

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from draftsmith import cli
from draftsmith.core import tensorio
from draftsmith.core.manifest import StageManifest, file_entry
from draftsmith.drafters import vocab
from draftsmith.drafters.eagle3 import export as eagle3_export
from draftsmith.drafters.eagle3.model import Eagle3Drafter, Eagle3Spec
from draftsmith.drafters.export import bundle, engines

pytestmark = pytest.mark.unit

RECIPE = Path(__file__).resolve().parents[2] / "deployments" / "recipes" / "tiny-cpu.yaml"


def _drafter(spec: Eagle3Spec, embed: torch.Tensor, seed: int = 0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    model = Eagle3Drafter(spec).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
        model.embed_tokens.weight.copy_(embed)
    counts = torch.randint(0, 100, (spec.vocab_size,))
    d2t, t2d = vocab.build_draft_vocab(counts, spec.draft_vocab_size)
    model.d2t.copy_(d2t)
    model.t2d.copy_(t2d)
    return model


def _bf16_copy(model: Eagle3Drafter) -> Eagle3Drafter:
    """What serving computes with: every exported float rounded to bf16 (the embedding is the target's, unrounded)."""
    twin = Eagle3Drafter(model.spec).eval()
    state = {
        k: v.to(torch.bfloat16).float() if v.is_floating_point() and not k.startswith("embed_tokens") else v
        for k, v in model.state_dict().items()
    }
    twin.load_state_dict(state)
    return twin


MLA = {"kv_lora_rank": 12, "q_lora_rank": 10, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6}


@torch.no_grad()
@pytest.mark.parametrize(
    ("engine", "attention"), [(e, "gqa") for e in engines.ENGINES] + [("vllm", "mla"), ("sglang", "mla")]
)
def test_eagle3_export_load_identical_logits(tmp_path, engine, attention):
    spec = Eagle3Spec(
        hidden_size=32, target_hidden_size=24, num_taps=3, num_heads=4, num_kv_heads=2, head_dim=8,
        intermediate_size=48, vocab_size=90, draft_vocab_size=30, fc_norm=True, norm_output=True,
        attention=attention, mla=MLA if attention == "mla" else None,
    )  # fmt: skip
    embed = torch.randn(90, 32)
    model = _drafter(spec, embed)
    taps = [2, 4, 7]
    blobs = bundle.export_drafter(
        "eagle3", model, taps, {"target": "t"}, engine=engine, num_target_layers=8, target_embed_VH=embed
    )
    folder = bundle.write_folder(tmp_path / engine, blobs)
    loaded, loaded_taps = eagle3_export.load_drafter(str(folder), embed)
    assert loaded_taps == taps
    config = json.loads((folder / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == engines.aux_layer_ids("eagle3", engine, taps)
    if attention == "mla":  # vLLM's deepseek_eagle3 loader: DeepSeek-V3 config fields, interleaved RoPE
        assert config["architectures"] == ["Eagle3DeepseekV3ForCausalLM"] and config["model_type"] == "deepseek_v3"
        assert config["kv_lora_rank"] == 12 and config["q_lora_rank"] == 10 and config["rope_interleave"] is True
        assert (
            "midlayer.self_attn.kv_a_proj_with_mqa.weight"
            in tensorio.loads((folder / "model.safetensors").read_bytes())[0]
        )
    ids = torch.randint(0, 90, (2, 11))
    feats = torch.randn(2, 11, 72) * 3
    want = _bf16_copy(model).ttt_forward(ids, feats, 3)
    got = loaded.ttt_forward(ids, feats, 3)
    for k, (w, g) in enumerate(zip(want, got, strict=True)):
        assert torch.equal(w, g), f"depth {k}: logits differ after the export round trip"
    # ...and the round trip is not vacuous: the fp32 original differs from its bf16 export.
    assert not torch.equal(model.ttt_forward(ids, feats, 3)[0], got[0])
    assert torch.equal(loaded.d2t, model.d2t) and torch.equal(loaded.t2d, model.t2d)


def _fake_run(tmp_path: Path, tiny_cfg, model: Eagle3Drafter, taps: list[int], store_taps: list[int]) -> Path:
    """A run folder as the pipeline leaves it: train/ (checkpoint + manifest) and the store's dataset.json."""
    run = tmp_path / "run"
    train = run / "train"
    meta = {"target": tiny_cfg.target.name, "train_key": "k" * 64, "tap_convention": "residual after layer k, from 1"}
    files = [file_entry(str(train), n, b) for n, b in eagle3_export.checkpoint_blobs(model, taps, meta).items()]
    manifest = StageManifest(stage="train", key="k" * 64, uri=str(train), files=files, info={"drafter": "eagle3"})
    (train / "manifest.json").write_text(manifest.model_dump_json())
    (run / "hidden_states").mkdir()
    dataset = {"taps": store_taps, "tap_point": "layer_output", "last_hidden": "post_norm", "tokenizer_sha256": "abc"}
    (run / "hidden_states" / "dataset.json").write_text(json.dumps(dataset))
    return run


@pytest.fixture(scope="module")
def tiny_model(tiny_cfg):
    from draftsmith.core.target_setup import resolve_target

    embed, _ = bundle.target_weights(resolve_target(tiny_cfg.target.source))
    d = tiny_cfg.drafter
    spec = Eagle3Spec(
        hidden_size=64, target_hidden_size=64, num_taps=3, num_heads=d.num_heads, num_kv_heads=d.num_kv_heads,
        head_dim=d.head_dim, intermediate_size=d.intermediate_size, vocab_size=embed.shape[0],
        draft_vocab_size=d.draft_vocab_size,
    )  # fmt: skip
    return _drafter(spec, embed), embed


@torch.no_grad()
def test_cli_export_of_a_run(tmp_path, tiny_cfg, tiny_model, capsys):
    model, embed = tiny_model
    taps = list(tiny_cfg.hidden_states.taps)
    run = _fake_run(tmp_path, tiny_cfg, model, taps, taps)
    assert cli.main(["export", str(run), "--engine", "sglang", "--recipe", str(RECIPE)]) == 0
    printed = capsys.readouterr().out
    folder = run / "export" / "sglang"
    assert f"--speculative-draft-model-path {folder.resolve()}" in printed
    assert "python -m sglang.launch_server --model-path" in printed and "--speculative-num-steps 3" in printed
    config = json.loads((folder / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [t - 1 for t in taps]
    meta = config["draftsmith"]
    from draftsmith.core.config import dump_recipe

    assert meta["taps"] == taps and meta["engine"] == "sglang" and meta["train_key"] == "k" * 64
    assert meta["recipe_sha256"] == hashlib.sha256(dump_recipe(tiny_cfg).encode()).hexdigest()
    assert meta["tap_point"] == "layer_output" and meta["last_hidden"] == "post_norm"
    assert meta["tokenizer_sha256"] == "abc" and len(meta["target_sha256"]) == 64
    tensors, _ = tensorio.loads((folder / "model.safetensors").read_bytes())
    assert "embed_tokens.weight" not in tensors and tensors["fc.weight"].dtype == torch.bfloat16
    loaded, loaded_taps = eagle3_export.load_drafter(str(folder), embed)
    assert loaded_taps == taps
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight.to(torch.bfloat16).float())

    out = str(tmp_path / "v")
    assert cli.main(["export", str(run), "--engine", "vllm", "--recipe", str(RECIPE), "--out", out]) == 0
    printed = capsys.readouterr().out
    spec_json = json.loads(printed.split("--speculative-config '")[1].split("'")[0])
    assert spec_json == {"method": "eagle3", "model": str((tmp_path / "v").resolve()), "num_speculative_tokens": 3}
    # vLLM reads the context at top level; the tiny target's is 2048.
    assert json.loads((tmp_path / "v" / "config.json").read_text())["max_position_embeddings"] == 2048

    for platform, head in (("gpu", "launch: vllm serve "), ("cpu", "launch: VLLM_CPU_KVCACHE_SPACE=1 ")):
        argv = ["export", str(run), "--engine", "vllm", "--recipe", str(RECIPE), "--out", out, "--port", "8123"]
        assert cli.main([*argv, "--platform", platform]) == 0
        launch = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("launch: "))
        assert launch.startswith(head) and launch.endswith(" --port 8123"), launch
        assert ("vllm.entrypoints.openai.api_server" in launch) == (platform == "cpu")


@torch.no_grad()
def test_cli_export_serves_the_schedule_speedup_measured_for_this_checkpoint(tmp_path, tiny_cfg, tiny_model, capsys):
    model, _ = tiny_model
    taps = list(tiny_cfg.hidden_states.taps)
    run = _fake_run(tmp_path, tiny_cfg, model, taps, taps)
    (run / "speedup").mkdir()
    ranges = [[1, 1, 3], [2, 3, 2], [4, 4, 0]]
    measured = {"train_key": "k" * 64, "schedule": {"per_level": {"1": 3, "2": 2, "4": 0}, "batch_size_ranges": ranges}}
    (run / "speedup" / "speedup.json").write_text(json.dumps(measured))
    argv = ["export", str(run), "--engine", "vllm", "--recipe", str(RECIPE), "--out", str(tmp_path / "v")]

    def spec() -> tuple[dict, str]:
        assert cli.main(argv) == 0
        printed = capsys.readouterr().out
        return json.loads(printed.split("--speculative-config '")[1].split("'")[0]), printed

    config, printed = spec()
    assert config["num_speculative_tokens_per_batch_size"] == [[1, 1, 3], [2, 3, 2], [4, 4, 0]]
    assert config["num_speculative_tokens"] == 3
    assert "note: draft tokens per batch size 1: 3, 2-3: 2, 4: 0 (the last range goes on" in printed
    launch = next(line for line in printed.splitlines() if line.startswith("launch: "))
    assert "num_speculative_tokens_per_batch_size" in launch, "the printed command serves the schedule too"
    # Measured for another checkpoint: the drafter's own depth, no schedule.
    (run / "speedup" / "speedup.json").write_text(json.dumps(measured | {"train_key": "x" * 64}))
    config, _ = spec()
    assert "num_speculative_tokens_per_batch_size" not in config and config["num_speculative_tokens"] == 3
    # Measured for this checkpoint with no level where it pays: no schedule, and the export says so.
    never = {"train_key": "k" * 64, "schedule": {"per_level": {"1": 0}, "batch_size_ranges": [[1, 1, 0]]}}
    (run / "speedup" / "speedup.json").write_text(json.dumps(never))
    config, printed = spec()
    assert "num_speculative_tokens_per_batch_size" not in config
    assert "found no concurrency where this drafter beats plain serving" in printed


def test_cli_export_refuses_a_run_whose_store_taps_differ(tmp_path, tiny_cfg, tiny_model, capsys):
    model, _ = tiny_model
    run = _fake_run(tmp_path, tiny_cfg, model, [1, 2, 3], [1, 2, 4])
    assert cli.main(["export", str(run), "--engine", "vllm", "--recipe", str(RECIPE)]) == 1
    assert "hidden_states/dataset.json: taps [1, 2, 4] != train/config.json [1, 2, 3]" in capsys.readouterr().err
    assert not (run / "export").exists()


def test_cli_export_refuses_a_drafter_with_a_foreign_embedding(tmp_path, tiny_cfg, tiny_model, capsys, monkeypatch):
    model, embed = tiny_model
    run = _fake_run(tmp_path, tiny_cfg, model, [1, 2, 3], [1, 2, 3])
    # The drafter was trained against another target: the target now on disk has a different embedding.
    monkeypatch.setattr(bundle, "target_weights", lambda folder: (embed.flip(0), embed.flip(0)))
    monkeypatch.setattr(bundle, "_load_trained", lambda *a: model)
    assert cli.main(["export", str(run), "--engine", "vllm", "--recipe", str(RECIPE)]) == 1
    assert "differs from the target's input embedding" in capsys.readouterr().err


def _dflash(embed: torch.Tensor, head: torch.Tensor, **kw):
    from draftsmith.drafters.dflash import DFlashDrafter, DFlashSpec

    torch.manual_seed(0)
    spec = DFlashSpec(
        hidden_size=32, target_hidden_size=24, num_taps=3, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
        intermediate_size=48, vocab_size=90, block_size=4, mask_token_id=7, **kw,
    )  # fmt: skip
    model = DFlashDrafter(spec).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
        model.embed_tokens.weight.copy_(embed)
        if spec.draft_vocab_size is None:
            model.lm_head.weight.copy_(head)
        else:
            d2t, t2d = vocab.build_draft_vocab(torch.randint(0, 100, (90,)), spec.draft_vocab_size)
            model.d2t.copy_(d2t)
            model.t2d.copy_(t2d)
    return model


def _bf16_twin(model: Any, keep: set[str]) -> Any:
    """`model` with every float rounded to bf16 except the shared tensors in `keep`."""
    twin = type(model)(model.spec).eval()
    twin.load_state_dict(
        {
            k: v.to(torch.bfloat16).float() if v.is_floating_point() and k not in keep else v
            for k, v in model.state_dict().items()
        }
    )
    return twin


@torch.no_grad()
@pytest.mark.parametrize(
    "kw",
    [
        {"draft_vocab_size": 30},
        {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4},
        {"layer_types": ("sliding_attention", "full_attention"), "sliding_window": 3},
    ],
    ids=["dflash-pruned", "dflash2-shared-head", "dflash-sliding"],
)
def test_dflash_export_load_identical_logits(tmp_path, kw):
    from draftsmith.drafters.dflash import export as dflash_export

    embed, head = torch.randn(90, 32), torch.randn(90, 32)
    model = _dflash(embed, head, **kw)
    taps = [2, 4, 7]
    blobs = bundle.export_drafter("dflash", model, taps, {}, engine="vllm", num_target_layers=8, target_embed_VH=embed)
    config = json.loads(blobs["config.json"])
    dflash2 = "conv_kernel_size" in kw
    assert config["architectures"] == ["DFlash2DraftModel" if dflash2 else "DFlashDraftModel"]
    assert config["model_type"] == "qwen3" and config["num_target_layers"] == 8
    assert config["dflash_config"]["target_layer_ids"] == [1, 3, 6]
    assert config["dflash_config"]["mask_token_id"] == 7 and config["block_size"] == 4
    assert bundle.method_module("dflash").num_speculative_tokens(config, None) == 3
    if dflash2:
        assert {k: config["dflash_config"][k] for k in kw} == kw
    tensors, _ = tensorio.loads(blobs["model.safetensors"])
    assert "embed_tokens.weight" not in tensors
    assert ("lm_head.weight" in tensors) == ("draft_vocab_size" in kw)
    folder = bundle.write_folder(tmp_path / "dflash", blobs)
    loaded, loaded_taps = dflash_export.load_drafter(str(folder), embed, head)
    assert loaded_taps == taps
    ids = torch.randint(0, 90, (2, 14))
    feats = torch.randn(2, 14, 72) * 3
    anchors = torch.tensor([[1, 5, 9], [0, 4, 8]])
    keep = torch.ones(2, 3, dtype=torch.bool)
    shared = {"embed_tokens.weight"} | ({"lm_head.weight"} if "draft_vocab_size" not in kw else set())
    want = _bf16_twin(model, shared)
    got_logits = loaded.logits(loaded.train_hidden(ids, feats, anchors, keep))
    assert torch.equal(want.logits(want.train_hidden(ids, feats, anchors, keep)), got_logits)
    assert not torch.equal(model.logits(model.train_hidden(ids, feats, anchors, keep)), got_logits)


@torch.no_grad()
@pytest.mark.parametrize(
    "kw", [{}, {"draft_vocab_size": 30, "confidence_head_with_markov": False}], ids=["full", "pruned"]
)
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_dspark_export_load_identical_outputs(tmp_path, kw, engine):
    from draftsmith.drafters.dspark import export as dspark_export
    from draftsmith.drafters.dspark.model import DSparkDrafter, DSparkSpec

    torch.manual_seed(0)
    spec = DSparkSpec(
        hidden_size=32, target_hidden_size=24, num_taps=3, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
        intermediate_size=48, vocab_size=90, block_size=4, mask_token_id=7, markov_rank=6, **kw,
    )  # fmt: skip
    model = DSparkDrafter(spec).eval()
    embed, head = torch.randn(90, 32), torch.randn(90, 32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
        model.embed_tokens.weight.copy_(embed)
        if "draft_vocab_size" in kw:
            d2t, t2d = vocab.build_draft_vocab(torch.randint(0, 100, (90,)), 30)
            model.d2t.copy_(d2t)
            model.t2d.copy_(t2d)
        else:
            model.lm_head.weight.copy_(head)
    taps = [2, 4, 7]
    blobs = bundle.export_drafter("dspark", model, taps, {}, engine=engine, num_target_layers=8, target_embed_VH=embed)
    config = json.loads(blobs["config.json"])
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["model_type"] == "qwen3"
    top = {k: config[k] for k in ("block_size", "target_layer_ids", "mask_token_id", "num_target_layers")}
    assert top == {"block_size": 4, "target_layer_ids": [1, 3, 6], "mask_token_id": 7, "num_target_layers": 8}
    assert config["markov_rank"] == 6 and config["markov_head_type"] == "vanilla" and config["sample_from_anchor"]
    assert config["enable_confidence_head"] is True
    assert config["confidence_head_with_markov"] is kw.get("confidence_head_with_markov", True)
    assert config.get("draft_vocab_size") == kw.get("draft_vocab_size")
    if engine == "sglang":
        assert config["dflash_config"]["projector_type"] == "dspark"
        assert config["dflash_config"]["target_layer_ids"] == [1, 3, 6]
    else:
        assert "dflash_config" not in config
    assert bundle.method_module("dspark").num_speculative_tokens(config, None) == 4
    folder = bundle.write_folder(tmp_path / "dspark", blobs)
    loaded, loaded_taps = dspark_export.load_drafter(str(folder), embed, head)
    assert loaded_taps == taps
    ids = torch.randint(0, 90, (2, 14))
    feats = torch.randn(2, 14, 72) * 3
    anchors, keep = torch.tensor([[1, 5, 9], [0, 4, 8]]), torch.ones(2, 3, dtype=torch.bool)
    shared = {"embed_tokens.weight"} | ({"lm_head.weight"} if "draft_vocab_size" not in kw else set())
    want = _bf16_twin(model, shared).train_outputs(ids, feats, anchors, keep)
    got = loaded.train_outputs(ids, feats, anchors, keep)
    for name, w, g in zip(("logits", "confidence", "markov"), want, got, strict=True):
        assert torch.equal(w, g), f"{name} differ after the export round trip"


@torch.no_grad()
def test_full_vocabulary_eagle3_ships_no_d2t(tmp_path):
    """vLLM has no draft_id_to_target_id when the draft vocabulary is the target's: d2t/t2d are left out."""
    spec = Eagle3Spec(
        hidden_size=32, target_hidden_size=24, num_taps=3, num_heads=4, num_kv_heads=2, head_dim=8,
        intermediate_size=48, vocab_size=40, draft_vocab_size=40,
    )  # fmt: skip
    embed = torch.randn(40, 32)
    model = _drafter(spec, embed)
    model.d2t.zero_()
    model.t2d.fill_(True)
    blobs = bundle.export_drafter(
        "eagle3", model, [1, 2, 3], {}, engine="vllm", num_target_layers=4, target_embed_VH=embed
    )
    tensors, _ = tensorio.loads(blobs["model.safetensors"])
    assert "d2t" not in tensors and "t2d" not in tensors
    loaded, _ = eagle3_export.load_drafter(str(bundle.write_folder(tmp_path / "full", blobs)), embed)
    assert torch.equal(loaded.d2t, torch.zeros(40, dtype=torch.int64)) and bool(loaded.t2d.all())


@torch.no_grad()
def test_cli_export_serves_eager_when_the_speedup_was_measured_eager(tmp_path, tiny_cfg, tiny_model, capsys):
    """`speedup.compile: false` measures servers with --enforce-eager; the printed command then serves the same."""
    model, _ = tiny_model
    taps = list(tiny_cfg.hidden_states.taps)
    run = _fake_run(tmp_path, tiny_cfg, model, taps, taps)
    eager_recipe = tmp_path / "eager.yaml"
    eager_recipe.write_text(RECIPE.read_text() + "\nspeedup:\n  compile: false\n")
    for recipe, eager in ((RECIPE, False), (eager_recipe, True)):
        for platform in ("cpu", "gpu"):
            argv = ["export", str(run), "--engine", "vllm", "--recipe", str(recipe), "--platform", platform]
            assert cli.main([*argv, "--out", str(tmp_path / "v")]) == 0
            launch = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("launch: "))
            assert ("--enforce-eager" in launch.split()) == eager, (recipe.name, platform, launch)
    assert "--enforce-eager" not in engines.launch_command("eagle3", "sglang", "/t", "/d", 3, eager=True)
