"""Triton dynamic depthwise convolution over block positions, forward and backward.

Program (i, k) covers rows `i*BLOCK_R ...` and channels `k*BLOCK_C ...` (BLOCK_C a multiple of the group
size GS). With coef[t, j, c] = base[j, c] + delta[t, j, c // GS] and pos(t) = (t mod Q) mod block_size:
  out[t]      = sum_j [pos(t) >= j]           coef[t, j]     * x[t - j]
  dx[t]       = sum_j [pos(t + j) = pos(t) + j] coef[t + j, j] * dy[t + j]   (t + j in the same block)
  ddelta[t,j,g] = sum_{c in g} [pos(t) >= j] dy[t, c] * x[t - j, c]
  dbase[j, c] = sum_t (same product)          (a partial per row block, summed after)
Loads are widened to fp32 (the interpreter's bf16 arithmetic is broken); stores cast to the output dtype.
"""

import triton
import triton.language as tl


@triton.jit
def conv_fwd_kernel(
    x_ptr, base_ptr, delta_ptr, y_ptr, R, H, G, Q, BS, s_dr, s_dj,
    TAPS: tl.constexpr, GS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    rok = rows < R
    cok = cols < H
    ok = rok[:, None] & cok[None, :]
    pos = rows % Q % BS
    grp = cols // GS
    rows64 = rows.to(tl.int64)
    acc = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    for j in tl.static_range(TAPS):
        okj = ok & (pos >= j)[:, None]
        xj = tl.load(x_ptr + (rows64 - j)[:, None] * H + cols[None, :], mask=okj, other=0.0).to(tl.float32)
        b = tl.load(base_ptr + j * H + cols, mask=cok, other=0.0).to(tl.float32)
        d = tl.load(delta_ptr + rows64[:, None] * s_dr + j * s_dj + grp[None, :], mask=ok, other=0.0).to(tl.float32)
        acc += (b[None, :] + d) * xj
    tl.store(y_ptr + rows64[:, None] * H + cols[None, :], acc.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def conv_bwd_kernel(
    x_ptr, base_ptr, delta_ptr, dy_ptr, dx_ptr, ddelta_ptr, dbase_ptr, R, H, G, Q, BS, s_dr, s_dj,
    TAPS: tl.constexpr, GS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    rows = i * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    rok = rows < R
    cok = cols < H
    ok = rok[:, None] & cok[None, :]
    pos = rows % Q % BS
    grp = cols // GS
    rows64 = rows.to(tl.int64)
    dy = tl.load(dy_ptr + rows64[:, None] * H + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    dx = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    NG: tl.constexpr = BLOCK_C // GS
    groups = tl.program_id(1) * NG + tl.arange(0, NG)
    for j in tl.static_range(TAPS):
        # dx: output row t + j used x[t] through tap j.
        okf = ok & ((pos + j) < BS)[:, None] & ((rows % Q + j) < Q)[:, None]
        dyf = tl.load(dy_ptr + (rows64 + j)[:, None] * H + cols[None, :], mask=okf, other=0.0).to(tl.float32)
        b = tl.load(base_ptr + j * H + cols, mask=cok, other=0.0).to(tl.float32)
        df = tl.load(delta_ptr + (rows64 + j)[:, None] * s_dr + j * s_dj + grp[None, :], mask=okf, other=0.0)
        dx += (b[None, :] + df.to(tl.float32)) * dyf
        # Kernel gradients: this row's output through tap j.
        okj = ok & (pos >= j)[:, None]
        xj = tl.load(x_ptr + (rows64 - j)[:, None] * H + cols[None, :], mask=okj, other=0.0).to(tl.float32)
        prod = dy * xj
        tl.store(dbase_ptr + (i.to(tl.int64) * TAPS + j) * H + cols, tl.sum(prod, 0), mask=cok)
        per_group = tl.sum(tl.reshape(prod, [BLOCK_R, NG, GS]), 2)
        gok = rok[:, None] & (groups < G)[None, :]
        tl.store(ddelta_ptr + (rows64[:, None] * TAPS + j) * G + groups[None, :], per_group, mask=gok)
    tl.store(dx_ptr + rows64[:, None] * H + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=ok)
