"""Model FLOPs utilisation: FLOPs of one training step, the device's peak FLOP/s, and their ratio.

FLOPs are counted once, before training, with `torch.utils.flop_counter.FlopCounterMode` on an unsharded model
(under FSDP the counter would see all-gathers, not the model). The peak is the vendor's dense figure for known
GPUs in 16-bit precision, else measured with square matmuls (CPUs, fp32 runs, unknown GPUs).
"""

import time
from collections.abc import Callable

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

# Dense (no 2:4 sparsity) BF16/FP16 tensor-core peaks per GPU, matched by substring of
# `torch.cuda.get_device_name()`, most specific first ("GB200" contains "B200", "H100 PCIe" contains "H100").
# Vendor figures: NVIDIA's H100/H200 datasheets give BF16 1,979 TFLOPS (SXM) and 1,513 (PCIe) *with* sparsity,
# i.e. 989 / 756 dense; NVIDIA's Blackwell specs give B200 (HGX, 1 kW) 2.25 PFLOPS and GB200 2.5 PFLOPS dense
# per GPU (4.5 / 5 with sparsity), B300 2.25 and GB300 2.5 dense; A100 312 TFLOPS dense.
_PEAK_BF16: tuple[tuple[str, float], ...] = (
    ("GB300", 2.5e15),
    ("GB200", 2.5e15),
    ("B300", 2.25e15),
    ("B200", 2.25e15),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("A100", 312e12),
)
_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _cpu_flash(query, key, value, *_, out_shape=None, **__) -> int:
    return sdpa_flop_count(query, key, value)


def _cpu_flash_backward(grad_out, query, key, value, *_, out_shape=None, **__) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


def flop_counter() -> FlopCounterMode:
    """A FlopCounterMode that also counts torch's CPU flash attention (SDPA on CPU, EAGLE-3's TTT attention),
    which torch's own table leaves out, as it counts SDPA elsewhere: every `[Q, K]` score, masked or not."""
    aten = torch.ops.aten
    mapping = {
        aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward,
    }
    return FlopCounterMode(display=False, custom_mapping=mapping)


def flops_per_step(fn: Callable[[], torch.Tensor]) -> float:
    """FLOPs of `fn()` (forward, returning a scalar loss) plus `loss.backward()`.

    `fn` closes over an unsharded model and one micro-batch; the backward leaves gradients in the model's
    `.grad` (zero them before training). Counts follow FlopCounterMode: a matmul of [m, k] @ [k, n] is
    2*m*k*n, attention via SDPA is counted, element-wise ops are not.
    """
    counter = flop_counter()
    with counter:
        loss = fn()
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            raise ValueError(
                f"flops_per_step: fn must return a scalar loss that requires grad, got "
                f"{type(loss).__name__}{list(loss.shape) if isinstance(loss, torch.Tensor) else ''}"
            )
        loss.backward()
    return float(counter.get_total_flops())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_matmuls(a: torch.Tensor, b: torch.Tensor, reps: int) -> float:
    _sync(a.device)
    start = time.perf_counter()
    for _ in range(reps):
        torch.mm(a, b)
    _sync(a.device)
    return time.perf_counter() - start


def measured_matmul_peak(dtype: torch.dtype, device: torch.device, *, size: int = 2048, seconds: float = 1.0) -> float:
    """Best FLOP/s of square matmuls in `dtype` on `device` (side `size`, or less), over about `seconds`.

    The side doubles from 128 up to `size` while one matmul stays under an eighth of the budget, so a slow
    path (bf16 on a CPU without bf16 units runs ~60x slower than fp32) never times one huge matmul and still
    gets several timed samples.
    """
    if size < 1 or seconds <= 0:
        raise ValueError(f"measured_matmul_peak: size and seconds must be positive, got {size}, {seconds}")
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(0)
    n = min(128, size)
    while True:
        a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
        b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
        one = _time_matmuls(a, b, 1)  # also the warm-up (kernel selection, page faults, clocks)
        if one > seconds / 8 or 2 * n > size:
            break
        n *= 2
    one = _time_matmuls(a, b, 1)
    # Chunks of ~1/10 of the budget: long enough to amortise the sync, many enough to take a best.
    reps = max(1, int(seconds / 10 / max(one, 1e-9)))
    best, spent = 0.0, 0.0
    while spent < seconds:
        dt = _time_matmuls(a, b, reps)
        spent += dt
        best = max(best, 2.0 * n**3 * reps / dt)
    return best


def device_peak_flops(device: torch.device, dtype: torch.dtype, *, override: float | None) -> tuple[float, str]:
    """Per-rank peak FLOP/s for MFU and where it came from: `override`, the GPU table, or a measured matmul."""
    if override is not None:
        if override <= 0:
            raise ValueError(f"train.metrics.peak_flops: must be positive, got {override}")
        return float(override), "override"
    device = torch.device(device)
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        name = torch.cuda.get_device_name(device)
        for key, peak in _PEAK_BF16:
            if key in name:
                return peak, f"table:{key}"
    peak = measured_matmul_peak(dtype, device)
    return peak, f"measured {_SHORT.get(dtype, str(dtype))} matmul"


def mfu(step_flops: float, seconds: float, peak: float) -> float:
    """Model FLOPs utilisation of one rank: achieved FLOP/s over `peak`."""
    if seconds <= 0:
        raise ValueError(f"mfu: seconds must be positive, got {seconds}")
    if peak <= 0:
        raise ValueError(f"mfu: peak must be positive, got {peak}")
    return step_flops / seconds / peak
