"""Which implementation runs: Triton on CUDA, the reference on CPU, Triton on CPU only when asked (interpreter)."""

import logging

import pytest
import torch

from draftsmith import kernels
from draftsmith.kernels import dispatch

pytestmark = pytest.mark.unit

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_auto_is_triton_on_cuda_and_the_reference_on_cpu_even_under_the_interpreter(monkeypatch):
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dispatch.choose("head_loss", CUDA, "auto") == "triton"
    assert dispatch.choose("head_loss", CPU, "auto") == "reference"
    assert dispatch.choose("head_loss", CUDA, "reference") == "reference"


def test_explicit_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dispatch.choose("rms_norm", CPU, "triton") == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(
        RuntimeError, match="kernels.rms_norm: the Triton kernel needs CUDA tensors or TRITON_INTERPRET"
    ):
        dispatch.choose("rms_norm", CPU, "triton")


def test_missing_triton_falls_back_on_auto_and_fails_clearly_when_requested(monkeypatch, caplog):
    monkeypatch.setattr(dispatch, "triton_available", lambda: False)
    dispatch._warn_missing_triton.cache_clear()
    with caplog.at_level(logging.WARNING, logger="draftsmith.kernels.dispatch"):
        assert dispatch.choose("head_loss", CUDA, "auto") == "reference"
    assert "triton is not installed" in caplog.text
    with pytest.raises(RuntimeError, match="kernels.dyn_conv: the Triton kernel was requested but triton is not"):
        dispatch.choose("dyn_conv", CUDA, "triton")


def test_the_process_mode_is_scoped_and_validated():
    assert kernels.get_mode() == "auto"
    with kernels.use("reference"):
        assert kernels.get_mode() == "reference"
        assert dispatch.choose("head_loss", CUDA) == "reference"
    assert kernels.get_mode() == "auto"
    with pytest.raises(ValueError, match="kernels mode: 'fast' is not one of"):
        kernels.set_mode("fast")


def test_the_train_config_switch_is_strict():
    from pydantic import ValidationError

    from draftsmith.core.config.train import TrainConfig

    assert TrainConfig().kernels == "auto"
    assert TrainConfig(kernels="reference").kernels == "reference"
    with pytest.raises(ValidationError, match="kernels"):
        TrainConfig(kernels="triton-please")
