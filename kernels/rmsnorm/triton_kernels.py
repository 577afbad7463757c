"""Triton RMSNorm over n equal segments of each row, forward and backward.

Program (i, s) handles rows `i*BLOCK_R ...` of segment s, sweeping the segment in BLOCK_H tiles: one pass for
the sum of squares, one to write. Backward, with r = rstd and u = w*dy:
  dx = r*u - x * r^3 * sum_h(u*x) / H,    dw = sum_rows dy * x * r  (a partial per row block, summed after).
Loads are widened to fp32 first (the interpreter's bf16 arithmetic is broken); stores cast to the output dtype.
"""

import triton
import triton.language as tl


@triton.jit
def rms_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, R, H, NSEG, eps, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    i = tl.program_id(0)
    s = tl.program_id(1)
    rows = i * BLOCK_R + tl.arange(0, BLOCK_R)
    rok = rows < R
    width = NSEG * H
    base = rows[:, None].to(tl.int64) * width + s * H
    acc = tl.zeros([BLOCK_R, BLOCK_H], tl.float32)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        ok = rok[:, None] & (cols < H)[None, :]
        x = tl.load(x_ptr + base + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        acc += x * x
    rstd = 1.0 / tl.sqrt(tl.sum(acc, 1) / H + eps)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        cok = cols < H
        ok = rok[:, None] & cok[None, :]
        x = tl.load(x_ptr + base + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + s * H + cols, mask=cok, other=0.0).to(tl.float32)
        y = w[None, :] * (x * rstd[:, None])
        tl.store(y_ptr + base + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=ok)
    tl.store(rstd_ptr + rows * NSEG + s, rstd, mask=rok)


@triton.jit
def rms_bwd_kernel(
    x_ptr, w_ptr, dy_ptr, rstd_ptr, dx_ptr, dwp_ptr, R, H, NSEG, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr
):
    i = tl.program_id(0)
    s = tl.program_id(1)
    rows = i * BLOCK_R + tl.arange(0, BLOCK_R)
    rok = rows < R
    width = NSEG * H
    base = rows[:, None].to(tl.int64) * width + s * H
    rstd = tl.load(rstd_ptr + rows * NSEG + s, mask=rok, other=0.0)
    acc = tl.zeros([BLOCK_R, BLOCK_H], tl.float32)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        cok = cols < H
        ok = rok[:, None] & cok[None, :]
        x = tl.load(x_ptr + base + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + base + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + s * H + cols, mask=cok, other=0.0).to(tl.float32)
        acc += w[None, :] * dy * x
    c = tl.sum(acc, 1) * rstd * rstd * rstd / H
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        cok = cols < H
        ok = rok[:, None] & cok[None, :]
        x = tl.load(x_ptr + base + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + base + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + s * H + cols, mask=cok, other=0.0).to(tl.float32)
        dx = rstd[:, None] * w[None, :] * dy - x * c[:, None]
        tl.store(dx_ptr + base + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=ok)
        dw = tl.sum(dy * x * rstd[:, None], 0)
        tl.store(dwp_ptr + i.to(tl.int64) * width + s * H + cols, dw, mask=cok)
