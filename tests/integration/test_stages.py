"""Each stage function on the tiny recipe: real target, real files, resumable, and checked."""

from typing import Any

import pytest
import torch

from draftsmith.core import storage, tensorio
from draftsmith.drafters.data import hidden_dataset
from draftsmith.drafters.eagle3.export import load_drafter
from draftsmith.engines import hf
from draftsmith.evals.suites import CATEGORIES
from draftsmith.tasks.regenerate import read_conversations
from draftsmith.tasks.tokenization import read_token_shard

pytestmark = pytest.mark.integration


def test_tokenize_masks_exactly_the_assistant_turns(tiny_cfg, tiny_run, tiny_target):
    _, tok = tiny_target
    m = tiny_run["tokenize"]
    rows = {r["id"]: r for r in read_conversations(tiny_run["regenerate"])}
    samples = [s for name in m.names("tokens-") for s in read_token_shard(storage.read_bytes(m.path(name)))]
    assert len(samples) == m.counts["samples"] > 0
    for s in samples:
        masked = tok.decode(s["input_ids"][s["loss_mask"]])
        expected = "".join(f"{x['content']}<|im_end|>\n" for x in rows[s["id"]]["messages"] if x["role"] == "assistant")
        if len(s["input_ids"]) < tiny_cfg.tokenize.max_length:
            assert masked == expected
        else:  # truncated: the mask covers a prefix of the assistant text
            assert expected.startswith(masked) and masked


def test_hidden_states_match_a_manual_layer_by_layer_forward(tiny_cfg, tiny_run, tiny_target):
    model, _ = tiny_target
    ds = hidden_dataset(tiny_run["hidden_states"])
    samples = [ds[i] for i in range(3)]
    base, layers, norm = hf.decoder_parts(model)  # a Llama-style decoder: called by its attribute names
    for s in samples[:3]:
        ids = s.input_ids[None]
        with torch.no_grad():
            x = base.embed_tokens(ids)
            pos = torch.arange(ids.shape[1])[None]
            rope = base.rotary_emb(x, position_ids=pos)
            mask = torch.full((ids.shape[1], ids.shape[1]), float("-inf")).triu(1)[None, None]
            outs = []
            for layer in layers:
                x = layer(x, attention_mask=mask, position_embeddings=rope, position_ids=pos)
                outs.append(x)
            manual_taps = torch.cat([outs[k - 1][0] for k in tiny_cfg.hidden_states.taps], dim=-1)
            manual_last = norm(outs[-1])[0]
        # Stored in bf16: the bf16 rounding of the fp32 forward. The stage runs padded batches, whose fp32 sums
        # may differ from this single-sequence forward in the last bits, so a value that lies on a bf16 rounding
        # boundary can round one ulp the other way: within one ulp everywhere, and equal almost everywhere.
        for stored, manual in ((s.features, manual_taps), (s.last_hidden, manual_last)):
            torch.testing.assert_close(stored.float(), manual, rtol=2**-7, atol=1e-6)
            assert (stored == manual.to(torch.bfloat16)).float().mean() > 0.999


def test_taps_equal_hf_hidden_states_bitwise_in_fp32(tiny_cfg, tiny_target):
    model, tok = tiny_target
    ids = torch.tensor([tok("Hello there, how are you today?")["input_ids"]])
    taps, last = hf.forward_with_taps(model, ids, torch.ones_like(ids), tiny_cfg.hidden_states.taps)
    ref = model(input_ids=ids, output_hidden_states=True).hidden_states
    for i, k in enumerate(tiny_cfg.hidden_states.taps):
        assert torch.equal(taps[0, :, i], ref[k][0])
    assert torch.equal(
        last[0], model.model.norm(ref[-2][0]) if len(ref) > model.config.num_hidden_layers + 1 else ref[-1][0]
    )


def test_hidden_state_shards_have_index_and_dataset_json(tiny_cfg, tiny_run, tiny_target):
    m = tiny_run["hidden_states"]
    dataset = storage.read_json(m.path("dataset.json"))
    assert dataset["taps"] == tiny_cfg.hidden_states.taps and dataset["last_hidden"] == "post_norm"
    assert dataset["tap_point"] == "layer_output" and dataset["codec"]["dtype"] == "bfloat16"
    assert dataset["tokenizer_sha256"] == tiny_run["tokenize"].info["tokenizer_sha256"]
    index = storage.read_jsonl(m.path("index.jsonl"))
    assert len(index) == m.counts["samples"] == dataset["samples"]
    shards = {s["shard"]: s for s in dataset["shards"]}
    for s in shards.values():  # the per-shard sha256 in dataset.json is the file's
        assert storage.sha256(storage.read_bytes(m.path(s["shard"]))) == s["sha256"]
    tensors, _ = tensorio.loads(storage.read_bytes(m.path(index[0]["shard"])))
    F = len(tiny_cfg.hidden_states.taps) * tiny_cfg.target.hidden_size
    assert tensors["hidden_states"].shape == (tensors["input_ids"].numel(), F)
    assert tensors["hidden_states"].dtype == torch.bfloat16
    tokens = [
        s
        for n in tiny_run["tokenize"].names("tokens-")
        for s in read_token_shard(storage.read_bytes(tiny_run["tokenize"].path(n)))
    ]
    assert [r["id"] for r in index] == [s["id"] for s in tokens]
    for row, tok in zip(index, tokens, strict=True):
        assert row["length"] == len(tok["input_ids"]) and row["loss_tokens"] == int(tok["loss_mask"].sum())


def test_train_writes_a_loadable_serving_checkpoint(tiny_cfg, tiny_run, tiny_target):
    model, _ = tiny_target
    m = tiny_run["train"]
    config = storage.read_json(m.path("config.json"))
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_aux_hidden_state_layer_ids"] == tiny_cfg.hidden_states.taps
    assert config["draft_vocab_size"] == tiny_cfg.drafter.draft_vocab_size
    drafter, taps = load_drafter(m.uri, model.get_input_embeddings().weight)
    assert taps == tiny_cfg.hidden_states.taps
    history = storage.read_jsonl(m.path("metrics.jsonl"))
    assert len(history) == m.counts["steps"] > 1
    assert history[-1]["loss"] < history[0]["loss"]


def test_evaluate_is_lossless_and_reports_acc_len(tiny_run):
    results = storage.read_json(tiny_run["evaluate"].path("results.json"))
    assert results["drafter"] == "eagle3"
    assert results["mismatched_outputs"] == 0
    assert results["acc_len"]["overall"] >= 1.0
    rows = storage.read_jsonl(tiny_run["evaluate"].path("prompts.jsonl"))
    rounds = sum(r["rounds"] for r in rows)
    assert results["acc_len"]["overall"] == pytest.approx(1 + sum(r["accepted"] for r in rows) / rounds, abs=1e-4)
    assert set(results["tokens_per_s"]) == {"baseline", "speculative"}
    # Every benchmark: the held-out prompts and the ten built-in suites (dialogue and followup two-turn).
    benches = {r["bench"] for r in results["benches"]}
    assert benches == {"held-out", *CATEGORIES}
    assert {r["turn"] for r in rows if r["bench"] == "dialogue"} == {0, 1}
    for r in results["benches"]:
        assert sum(r["accept_hist"]) == r["rounds"] and len(r["position_accept"]) == 3


def test_evaluate_renders_its_plots_as_pngs_of_the_fixed_size(tiny_run):
    from pathlib import Path

    from tests.support.runs import check_png

    for name in ("acc_len_by_bench", "position_acceptance"):
        check_png(Path(tiny_run["evaluate"].path(f"{name}.png")), name)


def test_rerun_is_served_from_the_manifest(tiny_cfg, tiny_run):
    from draftsmith.tasks.tokenization import tokenize

    m = tokenize(tiny_cfg.tokenize, tiny_cfg.target, tiny_run["regenerate"], out_uri=tiny_run["tokenize"].uri)
    assert m == tiny_run["tokenize"]


def _data_bytes(m) -> int:
    total = 0
    for name in m.names("shard-"):
        blob = storage.read_bytes(m.path(name))
        total += len(blob) - 8 - int.from_bytes(blob[:8], "little")  # the tensors, without the header
    return total


def test_plan_size_is_exact_once_tokens_exist(tiny_cfg, tiny_run, tmp_path):
    from draftsmith.plan import render_plan, store_size
    from draftsmith.tasks.hidden_states import capture_hidden_states

    size = store_size(tiny_cfg, tiny_run["run_dir"])
    assert size.exact and size.bytes == _data_bytes(tiny_run["hidden_states"])
    assert "exact (from the finished tokenize stage)" in render_plan(tiny_cfg, tiny_run["run_dir"])
    reduced = tiny_cfg.model_copy(
        update={
            "hidden_states": tiny_cfg.hidden_states.model_copy(
                update={"store_dtype": "fp8_e4m3", "positions": "supervised", "shard_samples": 5}
            )
        }
    )
    m = capture_hidden_states(reduced.hidden_states, reduced.target, tiny_run["tokenize"], out_uri=str(tmp_path / "hs"))
    size = store_size(reduced, tiny_run["run_dir"])
    assert size.bytes == _data_bytes(m) < _data_bytes(tiny_run["hidden_states"]) * 0.6
    assert size.supervised_rows == m.counts["loss_tokens"] < m.counts["tokens"]


def test_a_supervised_rows_store_trains_the_same_drafter(tiny_cfg, tiny_run, tmp_path):
    """Keeping the last hidden state only where a loss reads it loses nothing: the drafter is bitwise the same."""
    from draftsmith.tasks.hidden_states import capture_hidden_states
    from draftsmith.tasks.train import train

    c = tiny_cfg
    hs = c.hidden_states.model_copy(update={"positions": "supervised"})
    m = capture_hidden_states(hs, c.target, tiny_run["tokenize"], out_uri=str(tmp_path / "hs"))
    assert m.counts["bytes"] < tiny_run["hidden_states"].counts["bytes"]
    t = train(c.train, c.drafter, c.target, hs, tiny_run["tokenize"], m, seed=c.seed, out_uri=str(tmp_path / "train"))
    want = {f.name: f.digest for f in tiny_run["train"].files}
    assert {f.name: f.digest for f in t.files}["model.safetensors"] == want["model.safetensors"]


def test_a_crashed_capture_resumes_after_its_committed_shards(tiny_cfg, tiny_run, tmp_path, monkeypatch):
    from draftsmith.engines.hidden_capture import HFCapture
    from draftsmith.tasks.hidden_states import capture_hidden_states
    from draftsmith.transport.offline_store import ShardWriter

    c, uri = tiny_cfg, str(tmp_path / "hs")
    captured: list[Any] = []
    real_capture, real_add = HFCapture.capture, ShardWriter.add

    def counting(self, samples):
        captured.extend(s["id"] for s in samples)
        return real_capture(self, samples)

    def crash_after_one_shard(self, sample):
        if len(self.commits) == 1:
            raise RuntimeError("simulated crash")
        real_add(self, sample)

    monkeypatch.setattr(HFCapture, "capture", counting)
    monkeypatch.setattr(ShardWriter, "add", crash_after_one_shard)
    with pytest.raises(RuntimeError, match="simulated crash"):
        capture_hidden_states(c.hidden_states, c.target, tiny_run["tokenize"], out_uri=uri)
    monkeypatch.setattr(ShardWriter, "add", real_add)
    captured.clear()
    m = capture_hidden_states(c.hidden_states, c.target, tiny_run["tokenize"], out_uri=uri)
    shard = c.hidden_states.shard_samples
    assert len(captured) == m.counts["samples"] - shard  # the committed shard was not captured again
    # Capture windows end at shard boundaries, so the resumed capture forms the forward batches of an
    # uninterrupted one: every shard, the index and the dataset record are the same bytes.
    got = {f.name: f.digest for f in m.files}
    want = {f.name: f.digest for f in tiny_run["hidden_states"].files}
    assert got == want
