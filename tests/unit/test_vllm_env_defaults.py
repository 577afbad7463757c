"""The environment vLLM processes start with: every core for the model on a small CPU machine, the caller's
environment always winning."""

import os
import stat

import pytest

from draftsmith.engines import vllm_server
from draftsmith.engines.vllm_server import VLLMServer
from draftsmith.engines.vllm_worker import SMALL_MACHINE_CPUS, cpu_env_defaults, usable_cpus

pytestmark = pytest.mark.unit

RESERVED = "VLLM_CPU_NUM_OF_RESERVED_CPU"


@pytest.mark.parametrize("cpus", [1, SMALL_MACHINE_CPUS])
def test_small_machine_gives_the_model_every_core(cpus):
    assert cpu_env_defaults(cpus)[RESERVED] == "0"


@pytest.mark.parametrize("cpus", [SMALL_MACHINE_CPUS + 1, 16, 128])
def test_larger_machine_keeps_vllms_own_reservation(cpus):
    env = cpu_env_defaults(cpus)
    assert RESERVED not in env
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_usable_cpus_counts_this_process_affinity():
    assert 1 <= usable_cpus() <= (os.cpu_count() or 1)


def _fake_python(tmp_path):
    """An interpreter stand-in: the vLLM-distribution probe fails (so the server takes the vllm-cpu command),
    and the server command writes its environment to `env.txt` and exits 3."""
    dump = tmp_path / "env.txt"
    script = tmp_path / "python"
    script.write_text(f'#!/bin/sh\n[ "$1" = "-c" ] && exit 1\nenv > "{dump}"\nexit 3\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script), dump


def _child_env(tmp_path, monkeypatch, cpus: int) -> dict[str, str]:
    python, dump = _fake_python(tmp_path)
    monkeypatch.setattr(vllm_server, "VLLM_ENV_DEFAULTS", cpu_env_defaults(cpus))
    server = VLLMServer("some-model", python=python, max_model_len=64, log_path=str(tmp_path / "serve.log"))
    with pytest.raises(RuntimeError, match="exited with code 3"):
        server.start()
    return dict(line.split("=", 1) for line in dump.read_text().splitlines() if "=" in line)


def test_server_on_a_small_machine_reserves_no_core(tmp_path, monkeypatch):
    monkeypatch.delenv(RESERVED, raising=False)
    env = _child_env(tmp_path, monkeypatch, cpus=2)
    assert env[RESERVED] == "0"
    assert env["HF_HUB_OFFLINE"] == "1"


def test_callers_environment_overrides_the_default(tmp_path, monkeypatch):
    monkeypatch.setenv(RESERVED, "1")
    env = _child_env(tmp_path, monkeypatch, cpus=2)
    assert env[RESERVED] == "1"


def test_server_on_a_large_machine_sets_no_reservation(tmp_path, monkeypatch):
    monkeypatch.delenv(RESERVED, raising=False)
    env = _child_env(tmp_path, monkeypatch, cpus=64)
    assert RESERVED not in env
