"""Triton kernel of the fused head loss: one program per BLOCK_T rows of a chunk, the vocabulary in BLOCK_V tiles.

Per row it makes three passes over the row's logits (read from memory, never recomputed): (A) online
softmax statistics of draft and target plus argmaxes and the label's logit, kept per lane and merged at the
end; (B) only when L1 is asked, `sum |p_d - p_t|` and `sum sign(p_d - p_t) * p_d`; (C) the gradient of the
row's weighted loss with respect to its logits, written over the logits in place, so that the chunk's
`[C, V]` buffer becomes `dloss/dz` ready for the two gradient matmuls.

Gradients with respect to logits z (p_d = softmax z):
  soft CE  -sum p_t log p_d      -> p_d - p_t
  CE       -log p_d[label]       -> p_d - onehot(label)
  L1       sum |p_d - p_t|       -> p_d * (s - sum_v s_v p_d_v),   s = sign(p_d - p_t)

The logits arrive in the matmul's dtype (bf16 in training) and `dloss/dz` leaves in it, rounded to nearest
even as torch's cast rounds; everything in between is computed in fp32 (the interpreter's bf16 arithmetic is
broken; on a GPU fp32 is what we want).
"""

import triton
import triton.language as tl

# A constexpr: a jitted function may read a global only when it is one (the interpreter does not check).
FLOOR = tl.constexpr(-1.0e30)


@triton.jit
def _logits(ptrs, ok):
    """Logits of any float dtype as fp32, FLOOR in masked lanes (read as 0 first: FLOOR overflows fp16)."""
    return tl.where(ok, tl.load(ptrs, mask=ok, other=0.0).to(tl.float32), FLOOR)


@triton.jit
def _first_argmax(best, idx, big):
    """Per row of `[BLOCK_T, BLOCK_V]` lanes: the smallest column index holding the row's maximum."""
    m = tl.max(best, 1)
    return tl.min(tl.where(best == m[:, None], idx, big), 1)


@triton.jit
def _stats_pass(
    z_rows, zt_rows, label, rok, V,
    HAS_T: tl.constexpr, HAS_LABEL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """(A) Per row: lse and argmax of draft and target, soft CE and CE. Lane j sees columns j, j + BLOCK_V, ..."""
    lanes = tl.arange(0, BLOCK_V)[None, :]
    m_d = tl.full([BLOCK_T, BLOCK_V], FLOOR, tl.float32)
    s_d = tl.zeros([BLOCK_T, BLOCK_V], tl.float32)
    i_d = tl.zeros([BLOCK_T, BLOCK_V], tl.int32)
    m_t = tl.full([BLOCK_T, BLOCK_V], FLOOR, tl.float32)
    s_t = tl.zeros([BLOCK_T, BLOCK_V], tl.float32)
    a_t = tl.zeros([BLOCK_T, BLOCK_V], tl.float32)  # sum exp(zt - m_t) * z, rescaled with m_t
    b_t = tl.full([BLOCK_T, BLOCK_V], FLOOR, tl.float32)
    i_t = tl.zeros([BLOCK_T, BLOCK_V], tl.int32)
    z_lab = tl.zeros([BLOCK_T, BLOCK_V], tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + lanes
        ok = rok[:, None] & (cols < V)
        d = _logits(z_rows + cols, ok)
        i_d = tl.where(d > m_d, cols, i_d)  # strict: the first maximum of a lane wins, as torch.argmax
        m_new = tl.maximum(m_d, d)
        s_d = s_d * tl.exp(m_d - m_new) + tl.where(ok, tl.exp(d - m_new), 0.0)
        m_d = m_new
        if HAS_T:
            t = _logits(zt_rows + cols, ok)
            live = ok & (t > FLOOR)
            i_t = tl.where(t > b_t, cols, i_t)
            b_t = tl.maximum(b_t, t)
            mt_new = tl.maximum(m_t, t)
            scale = tl.exp(m_t - mt_new)
            e = tl.where(live, tl.exp(t - mt_new), 0.0)
            s_t = s_t * scale + e
            a_t = a_t * scale + e * tl.where(ok, d, 0.0)
            m_t = mt_new
        if HAS_LABEL:
            z_lab += tl.where(cols == label[:, None], d, 0.0)
    big = V + BLOCK_V
    arg_d = _first_argmax(m_d, i_d, big)
    M_d = tl.max(m_d, 1)
    # A real row's sums are >= 1 (its maximum contributes exp(0)); the clamp only keeps padding rows finite.
    lse_d = M_d + tl.log(tl.maximum(tl.sum(s_d * tl.exp(m_d - M_d[:, None]), 1), 1.0))
    soft = tl.zeros([BLOCK_T], tl.float32)
    lse_t = tl.zeros([BLOCK_T], tl.float32)
    arg_t = tl.zeros([BLOCK_T], tl.int32)
    if HAS_T:
        M_t = tl.max(m_t, 1)
        scale_t = tl.exp(m_t - M_t[:, None])
        S_t = tl.maximum(tl.sum(s_t * scale_t, 1), 1.0)
        lse_t = M_t + tl.log(S_t)
        soft = lse_d - tl.sum(a_t * scale_t, 1) / S_t
        arg_t = _first_argmax(b_t, i_t, big)
    return lse_d, lse_t, soft, lse_d - tl.sum(z_lab, 1), arg_d, arg_t


@triton.jit
def _l1_pass(z_rows, zt_rows, rok, V, lse_d, lse_t, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr):
    """(B) Per row: L1 = sum |p_d - p_t| and sum sign(p_d - p_t) * p_d (its gradient needs it)."""
    lanes = tl.arange(0, BLOCK_V)[None, :]
    l1_lane = tl.zeros([BLOCK_T, BLOCK_V], tl.float32)
    sd_lane = tl.zeros([BLOCK_T, BLOCK_V], tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + lanes
        ok = rok[:, None] & (cols < V)
        p_d = tl.where(ok, tl.exp(_logits(z_rows + cols, ok) - lse_d[:, None]), 0.0)
        t = _logits(zt_rows + cols, ok)
        p_t = tl.where(ok & (t > FLOOR), tl.exp(t - lse_t[:, None]), 0.0)
        diff = p_d - p_t
        l1_lane += tl.abs(diff)
        sd_lane += tl.where(diff > 0, p_d, tl.where(diff < 0, -p_d, 0.0))
    return tl.sum(l1_lane, 1), tl.sum(sd_lane, 1)


@triton.jit
def _grad_pass(
    z_rows, zt_rows, rok, V, label, lse_d, lse_t, sdot, w_soft, w_ce, w_l1,
    HAS_T: tl.constexpr, NEED_L1: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """(C) dloss/dz written over the logits, in place; w_* are `[BLOCK_T, 1]` row weights."""
    lanes = tl.arange(0, BLOCK_V)[None, :]
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + lanes
        ok = rok[:, None] & (cols < V)
        p_d = tl.exp(_logits(z_rows + cols, ok) - lse_d[:, None])
        g = (w_soft + w_ce) * p_d - w_ce * tl.where(cols == label[:, None], 1.0, 0.0)
        if HAS_T:
            t = _logits(zt_rows + cols, ok)
            p_t = tl.where(t > FLOOR, tl.exp(t - lse_t[:, None]), 0.0)
            g -= w_soft * p_t
            if NEED_L1:
                diff = p_d - p_t
                sign = tl.where(diff > 0, 1.0, tl.where(diff < 0, -1.0, 0.0))
                g += w_l1 * p_d * (sign - sdot[:, None])
        tl.store(z_rows + cols, g.to(z_rows.dtype.element_ty), mask=ok)  # the logits' dtype, rounded to nearest


@triton.jit
def head_rows_kernel(
    z_ptr,  # [C, V] draft logits (any float dtype); overwritten with dloss/dz in that dtype
    zt_ptr,  # [C, V] target logits (any float dtype), FLOOR where p_t = 0
    lab_ptr,  # [T] int64 labels
    w_ptr,  # [3, T] fp32 row weights (soft CE, CE, L1)
    out_ptr,  # [3, T] fp32 per-row soft CE, CE, L1
    arg_ptr,  # [2, T] int64 per-row argmax of draft and target
    row0,
    C,
    T,
    V,
    stride_z,
    stride_zt,
    HAS_T: tl.constexpr,
    HAS_LABEL: tl.constexpr,
    NEED_L1: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rok = r < C
    row = row0 + r
    z_rows = z_ptr + r.to(tl.int64)[:, None] * stride_z
    zt_rows = zt_ptr + r.to(tl.int64)[:, None] * stride_zt
    label = tl.full([BLOCK_T], -1, tl.int64)
    if HAS_LABEL:
        label = tl.load(lab_ptr + row, mask=rok, other=-1)
    lse_d, lse_t, soft, ce, arg_d, arg_t = _stats_pass(
        z_rows, zt_rows, label, rok, V, HAS_T, HAS_LABEL, BLOCK_T, BLOCK_V
    )
    l1 = tl.zeros([BLOCK_T], tl.float32)
    sdot = tl.zeros([BLOCK_T], tl.float32)
    if NEED_L1:
        l1, sdot = _l1_pass(z_rows, zt_rows, rok, V, lse_d, lse_t, BLOCK_T, BLOCK_V)
    w_soft = tl.load(w_ptr + row, mask=rok, other=0.0)[:, None]
    w_ce = tl.load(w_ptr + T + row, mask=rok, other=0.0)[:, None]
    w_l1 = tl.load(w_ptr + 2 * T + row, mask=rok, other=0.0)[:, None]
    _grad_pass(z_rows, zt_rows, rok, V, label, lse_d, lse_t, sdot, w_soft, w_ce, w_l1, HAS_T, NEED_L1, BLOCK_V)
    tl.store(out_ptr + row, soft, mask=rok)
    tl.store(out_ptr + T + row, ce, mask=rok)
    tl.store(out_ptr + 2 * T + row, l1, mask=rok)
    tl.store(arg_ptr + row, arg_d.to(tl.int64), mask=rok)
    tl.store(arg_ptr + T + row, arg_t.to(tl.int64), mask=rok)
