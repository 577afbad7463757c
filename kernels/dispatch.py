"""Which implementation an op runs: the Triton kernel or the PyTorch reference.

Rules (`choose`):
- `reference`: always the reference.
- `triton`: the kernel, or a clear error when triton is missing or the tensors are on neither a GPU nor the
  interpreter (CPU tensors with `TRITON_INTERPRET=1`: how the tests run the kernels).
- `auto` (default): the kernel on CUDA tensors (when triton is installed), the reference elsewhere. CPU
  stays on the reference even under the interpreter: production CPU installs may lack triton, the interpreter
  is far too slow to train with, and a test session that turns it on must not slow every other test down.

The process-wide mode is set once per training rank from `train.kernels` (`set_mode`), or scoped with `use`.
triton is imported lazily, never at module import: `TRITON_INTERPRET` must be set before the first import.
"""

import contextlib
import functools
import importlib.util
import logging
import os
from collections.abc import Iterator
from typing import Literal, cast

import torch

Mode = Literal["auto", "reference", "triton"]
MODES: tuple[str, ...] = ("auto", "reference", "triton")

log = logging.getLogger(__name__)
_mode: Mode = "auto"


def interpreting() -> bool:
    """Is triton's CPU interpreter on (it must be set before triton is first imported)?"""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def set_mode(mode: str) -> None:
    """Set the process-wide kernel mode (`auto`, `reference` or `triton`)."""
    global _mode
    if mode not in MODES:
        raise ValueError(f"kernels mode: {mode!r} is not one of {MODES}")
    _mode = cast(Mode, mode)  # one of MODES, checked above


def get_mode() -> Mode:
    return _mode


@contextlib.contextmanager
def use(mode: str) -> Iterator[None]:
    """Run a block under another kernel mode, restoring the previous one after."""
    before = _mode
    set_mode(mode)
    try:
        yield
    finally:
        set_mode(before)


@functools.cache
def _warn_missing_triton(device: str) -> None:
    log.warning("kernels: triton is not installed; %s tensors use the PyTorch reference", device)


def choose(op: str, device: torch.device, mode: str | None = None) -> Literal["triton", "reference"]:
    """`triton` or `reference` for `op` on tensors living on `device` (see the module rules)."""
    mode = mode or _mode
    if mode not in MODES:
        raise ValueError(f"kernels mode: {mode!r} is not one of {MODES}")
    if mode == "reference":
        return "reference"
    if mode == "triton":
        runnable = device.type == "cuda" or (device.type == "cpu" and interpreting())
        if not triton_available():
            raise RuntimeError(
                f"kernels.{op}: the Triton kernel was requested but triton is not installed "
                "(install the `dev` extra, or set train.kernels: reference)"
            )
        if not runnable:
            raise RuntimeError(
                f"kernels.{op}: the Triton kernel needs CUDA tensors or TRITON_INTERPRET=1, got {device.type} tensors"
            )
        return "triton"
    if device.type != "cuda":
        return "reference"
    if not triton_available():
        _warn_missing_triton(device.type)
        return "reference"
    return "triton"
