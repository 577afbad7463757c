"""A run folder is trusted only as far as its files match their manifests: a truncated, bit-flipped or
deleted artifact is named and recomputed, never served from cache, and a copied run folder answers for
its own files. Each test corrupts a copy of the tiny run, never the shared one."""

import hashlib
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from draftsmith import cli
from draftsmith.tasks.hidden_states import capture_hidden_states
from draftsmith.tasks.tokenization import tokenize
from draftsmith.tasks.train import train
from tests.support.runs import manifest

pytestmark = pytest.mark.integration

RECIPE = Path(__file__).resolve().parents[2] / "deployments" / "recipes" / "tiny-cpu.yaml"


def _copy(tiny_run: dict, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(tiny_run["run_dir"], run)
    return run


def _digests(manifest) -> list[tuple[str, int, str]]:
    return [(f.name, f.bytes, f.digest) for f in manifest.files]


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_truncated_hidden_state_shard_is_captured_again(tiny_cfg, tiny_run, tmp_path, caplog):
    c = tiny_cfg
    run = _copy(tiny_run, tmp_path)
    shard = run / "hidden_states" / "shard-00000.safetensors"
    whole = shard.read_bytes()
    shard.write_bytes(whole[: len(whole) // 2])
    with caplog.at_level(logging.WARNING):
        m = capture_hidden_states(
            c.hidden_states, c.target, manifest(str(run / "tokenize")), out_uri=str(run / "hidden_states")
        )
    assert shard.read_bytes() == whole  # captured again, not the half file re-recorded
    assert _digests(m) == _digests(tiny_run["hidden_states"])
    assert any(str(shard) in r.getMessage() for r in caplog.records), "the damaged shard is named"
    # The same hidden states chain to the same train key: the checkpoint is the uncorrupted run's.
    t = train(
        c.train,
        c.drafter,
        c.target,
        c.hidden_states,
        manifest(str(run / "tokenize")),
        m,
        seed=c.seed,
        out_uri=str(run / "train"),
    )
    assert _digests(t) == _digests(tiny_run["train"])


def test_one_flipped_bit_in_a_token_shard_recomputes_tokenize(tiny_cfg, tiny_run, tmp_path, caplog):
    c = tiny_cfg
    run = _copy(tiny_run, tmp_path)
    shard = run / "tokenize" / "tokens-00000.safetensors"
    whole = shard.read_bytes()
    flipped = bytearray(whole)
    flipped[-3] ^= 0x01  # in the tensor data, same size: a size check cannot see it
    shard.write_bytes(bytes(flipped))
    with caplog.at_level(logging.WARNING):
        m = tokenize(c.tokenize, c.target, manifest(str(run / "regenerate")), out_uri=str(run / "tokenize"))
    assert shard.read_bytes() == whole
    assert _digests(m) == _digests(tiny_run["tokenize"])
    assert any(str(shard) in r.getMessage() for r in caplog.records), "the damaged shard is named"


def test_a_copied_run_folder_answers_for_its_own_files(tiny_cfg, tiny_run, tmp_path):
    c = tiny_cfg
    original = Path(tiny_run["run_dir"])
    before = _snapshot(original / "tokenize")
    run = _copy(tiny_run, tmp_path)
    assert str(original) not in (run / "train" / "manifest.json").read_text()
    assert manifest(str(run / "train")).uri == str(run / "train")  # the printed checkpoint is the copy's
    (run / "tokenize" / "tokens-00000.safetensors").unlink()
    m = tokenize(c.tokenize, c.target, manifest(str(run / "regenerate")), out_uri=str(run / "tokenize"))
    assert m.uri == str(run / "tokenize")
    assert (run / "tokenize" / "tokens-00000.safetensors").read_bytes() == before["tokens-00000.safetensors"]
    assert _snapshot(original / "tokenize") == before


def test_export_of_a_tampered_checkpoint_fails_naming_the_file(tiny_run, tmp_path, capsys):
    run = _copy(tiny_run, tmp_path)
    weights = run / "train" / "model.safetensors"
    with safe_open(weights, "pt") as fh:
        metadata = fh.metadata()
    tensors = load_file(weights)
    name = "fc.weight" if "fc.weight" in tensors else next(n for n, t in tensors.items() if t.is_floating_point())
    tensors[name] = torch.zeros_like(tensors[name])  # same shape, dtype and size: only the digest can tell
    save_file(tensors, weights, metadata=metadata)
    assert cli.main(["export", str(run), "--engine", "vllm", "--recipe", str(RECIPE)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("export failed: ") and "\n" not in err
    assert str(weights) in err
    assert not (run / "export").exists()


def test_an_old_manifest_with_sha256_and_absolute_paths_still_reads(tmp_path):
    stage = tmp_path / "moved" / "tokenize"
    stage.mkdir(parents=True)
    (stage / "a.bin").write_bytes(b"abc")
    old: dict[str, object] = {"stage": "tokenize", "key": "k", "uri": "/elsewhere/tokenize", "created_at": "t"}
    old["files"] = [{"name": "/elsewhere/tokenize/a.bin", "bytes": 3, "sha256": hashlib.sha256(b"abc").hexdigest()}]
    (stage / "manifest.json").write_text(json.dumps(old))
    m = manifest(str(stage))
    assert m.uri == str(stage) and m.names() == ["a.bin"] and m.files[0].algo == "sha256"
    assert m.artifacts_present()
    (stage / "a.bin").write_bytes(b"abd")
    assert "a.bin: sha256" in (m.problem() or "")
