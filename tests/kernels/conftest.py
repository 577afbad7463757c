"""Kernel tests run the Triton kernels on CPU under triton's interpreter.

`TRITON_INTERPRET=1` must be set before triton is first imported (triton.language builds its builtins at
import), hence here at conftest import. It does not change what other tests run: `draftsmith.kernels.dispatch` keeps CPU
tensors on the reference unless a kernel is requested explicitly (`mode="triton"`), as these tests do.
"""

import os
import sys

import pytest
import torch

_TRITON_PREIMPORTED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not _TRITON_PREIMPORTED:
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture
def interpreter():
    """Skip without triton (a production CPU install); fail if triton was imported without the interpreter."""
    pytest.importorskip("triton")
    if _TRITON_PREIMPORTED:
        pytest.fail(
            "triton was imported before TRITON_INTERPRET=1 could be set: set it in tests/conftest.py "
            "or run tests/kernels in its own pytest process"
        )


@pytest.fixture
def poisoned_empty(monkeypatch):
    """`torch.empty`/`empty_like` return NaN (floats) or a sentinel (ints): an output a kernel forgets to
    write shows up as NaN or a wrong index instead of passing by luck with zeroed memory."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def fill(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-12345)

    monkeypatch.setattr(torch, "empty", lambda *a, **k: fill(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: fill(real_empty_like(*a, **k)))
