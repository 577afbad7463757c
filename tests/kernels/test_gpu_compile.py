"""Every Triton kernel launch the ops make compiles for Hopper (sm_90) and Blackwell (sm_100) GPUs.

The interpreter runs each op forward and backward in every kernel variant the drafters use (the head loss
with the target as logits, hidden states + head and top-k; with and without labels, L1 and the DSpark extra
term; fp32, bf16 and fp16 inputs); `draftsmith.kernels.gpu_compile` records the launches, and a child
process without the interpreter compiles each one to a cubin with triton's own compiler and ptxas. A kernel
that the interpreter runs but the compiler refuses fails here, on a machine with no GPU.
"""

import importlib
import json
import os
import subprocess
import sys

import pytest
import torch

from draftsmith.kernels.dyn_conv import dyn_conv
from draftsmith.kernels.head_loss import Target, head_loss
from draftsmith.kernels.rmsnorm import rms_norm

pytestmark = [pytest.mark.unit, pytest.mark.slow]

T, D, V, R, HT, K = 9, 16, 70, 4, 8, 3


def _targets(dtype: torch.dtype, g: torch.Generator) -> list[Target | None]:
    ids = torch.rand(T, V, generator=g).argsort(-1)[:, :K]
    return [
        None,
        Target(logits=torch.randn(T, V, generator=g).to(dtype)),
        Target(hidden=torch.randn(T, HT, generator=g).to(dtype), head=torch.randn(V, HT, generator=g).to(dtype)),
        Target(topk_ids=ids, topk_logp=torch.randn(T, K, generator=g).log_softmax(-1)),
    ]


def _head_losses(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    for target in _targets(dtype, g):
        for labels, l1, extra in ((True, False, False), (True, True, True), (False, True, False)):
            if target is None and not labels:
                continue
            x = torch.randn(T, D, generator=g).to(dtype).requires_grad_(True)
            w = torch.randn(V, D, generator=g).to(dtype).requires_grad_(True)
            pair = (torch.randn(T, R, generator=g).to(dtype), torch.randn(V, R, generator=g).to(dtype))
            out = head_loss(
                x, w, target=target, labels=torch.randint(0, V, (T,), generator=g) if labels else None,
                w_soft=torch.rand(T, generator=g) if target is not None else None,
                w_ce=torch.rand(T, generator=g) if labels else None,
                w_l1=torch.rand(T, generator=g) if l1 and target is not None else None,
                extra=pair if extra else None, chunk_rows=4, block_v=32, mode="triton",
            )  # fmt: skip
            out.loss.backward()


def _norms_and_convs(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    for n in (1, 3):
        x = torch.randn(5, n * 24, generator=g).to(dtype).requires_grad_(True)
        rms_norm(x, torch.ones(n, 24, requires_grad=True), 1e-5, mode="triton").sum().backward()
    for taps in (2, 3):
        x = torch.randn(2, 11, 32, generator=g).to(dtype).requires_grad_(True)
        base = torch.randn(taps, 32, generator=g).to(dtype).requires_grad_(True)
        delta = torch.randn(2, 11, taps, 2, generator=g).to(dtype).requires_grad_(True)
        dyn_conv(x, base, delta, 4, mode="triton").sum().backward()


def _compile(launches: list[dict], tmp_path, pythonpath=None) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """Compile `launches` in a child process without the interpreter, with a fresh triton cache (every launch
    really compiles); the process and its per-launch JSON results."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    proc = subprocess.run(
        [sys.executable, "-m", "draftsmith.kernels.gpu_compile"], input=json.dumps(launches), capture_output=True,
        text=True, env=env, cwd=tmp_path, timeout=600,
    )  # fmt: skip
    return proc, [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_every_launch_compiles_for_hopper_and_blackwell(interpreter, tmp_path):
    from draftsmith.kernels import gpu_compile

    with gpu_compile.recording() as launches:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            _head_losses(dtype)
            _norms_and_convs(dtype)
    kernels = {launch["kernel"].rpartition(":")[2] for launch in launches}
    assert {"head_rows_kernel", "rms_fwd_kernel", "rms_bwd_kernel", "conv_fwd_kernel", "conv_bwd_kernel"} <= kernels

    proc, results = _compile(launches, tmp_path)
    failures = [f"{r['kernel']} sm_{r['arch']} {r['constexprs']}: {r['error']}" for r in results if not r["ok"]]
    assert not failures, "\n".join(failures)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(results) == len(launches) * len(gpu_compile.ARCHS)
    assert all("cubin" in r["stages"] for r in results)


def test_a_global_the_compiler_cannot_read_is_reported(interpreter, tmp_path):
    """The check can fail: a kernel reading a plain Python global runs in the interpreter, not in the compiler."""
    module = tmp_path / "plain_global_kernel.py"
    module.write_text(
        "import triton\nimport triton.language as tl\nSCALE = 2.0\n\n"
        "@triton.jit\ndef scale_kernel(x_ptr, n, BLOCK: tl.constexpr):\n"
        "    i = tl.arange(0, BLOCK)\n    m = i < n\n"
        "    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=m) * SCALE, mask=m)\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        scale_kernel = importlib.import_module("plain_global_kernel").scale_kernel  # written above, not installed

        from draftsmith.kernels import gpu_compile

        x = torch.ones(5)
        with gpu_compile.recording() as launches:
            scale_kernel[(1,)](x, 5, BLOCK=8)
        assert x.tolist() == [2.0] * 5  # the interpreter ran it
    finally:
        sys.path.remove(str(tmp_path))
    proc, results = _compile(launches, tmp_path, pythonpath=tmp_path)
    assert proc.returncode == 1 and results and not any(r["ok"] for r in results)
    assert "SCALE" in results[0]["error"]
