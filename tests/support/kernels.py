"""The kernel parity tests' helpers: named tolerances, each with the reason it is what it is, and the fused
head loss's inputs, runs and comparison (shared by its Triton and eager tests).

Tolerances are `torch.testing.assert_close` keyword sets (rtol, atol).
"""

from typing import TypedDict

import torch
from torch.testing import assert_close

from draftsmith.kernels.head_loss import Target, head_loss


class Tol(TypedDict):
    rtol: float
    atol: float


# fp32 on both sides, same formulas: only the summation order differs (per-lane online softmax and tiled
# sums in the kernel, torch's reductions in the reference), a few fp32 ulps on values of order 1-10.
FP32: Tol = {"rtol": 2e-5, "atol": 2e-5}

# Head loss with fp16 / bf16 inputs: the logits come from the very same torch matmul on both sides and every
# softmax sum is fp32, so the loss terms agree like fp32 ones. Gradients pass through one cast of dloss/dz to
# the input dtype before the gradient matmuls on both sides; an fp32 difference of a few ulps can flip that
# rounding, so a gradient element may differ by one ulp of the dtype (fp16 2^-10, bf16 2^-7), in relative
# terms of the largest contributing product: hence an atol scaled by the gradient's magnitude.
HEAD_GRAD: dict[str, Tol] = {"float32": {"rtol": 1e-4, "atol": 1e-5}, "float16": {"rtol": 2e-3, "atol": 2e-3}}
HEAD_GRAD["bfloat16"] = {"rtol": 1.6e-2, "atol": 1.6e-2}

# Elementwise kernels (RMSNorm, dyn conv) on fp16 / bf16 inputs, compared with the reference run in fp32 on
# the same (upcast) inputs and cast back: the kernel also computes in fp32, so the one difference is the final
# store. fp16 stores round (half an ulp, 2^-11 relative); the Triton interpreter's bf16 stores truncate instead
# of rounding, so up to one full bf16 ulp (2^-7 relative, 2^-8 for the rounded reference).
STORE: dict[str, Tol] = {"float16": {"rtol": 1e-3, "atol": 1e-3}, "bfloat16": {"rtol": 8e-3, "atol": 8e-3}}


# The fused head loss at odd shapes: T = 63 rows in chunks of 20, V = 300 in vocabulary tiles of 64 (neither
# divides), D = 72; the target as logits, as hidden states + head, or as top-5.
HEAD_T, HEAD_D, HEAD_V, HEAD_R, HEAD_HT, HEAD_K = 63, 72, 300, 8, 24, 5


HEAD_CHUNK_ROWS, HEAD_BLOCK_V = 20, 64


def head_target(form: str, dtype: torch.dtype, g: torch.Generator) -> Target:
    if form == "logits":
        return Target(logits=(torch.randn(HEAD_T, HEAD_V, generator=g) * 2).to(dtype))
    if form == "hidden":
        head = torch.randn(HEAD_V, HEAD_HT, generator=g) * (3 / HEAD_HT**0.5)
        return Target(hidden=torch.randn(HEAD_T, HEAD_HT, generator=g).to(dtype), head=head.to(dtype))
    ids = torch.rand(HEAD_T, HEAD_V, generator=g).argsort(-1)[:, :HEAD_K]
    return Target(topk_ids=ids, topk_logp=torch.randn(HEAD_T, HEAD_K, generator=g).log_softmax(-1))


def head_inputs(dtype: torch.dtype, form: str | None, extra: bool, frozen_weight: bool = False):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(HEAD_T, HEAD_D, generator=g).to(dtype).requires_grad_(True)
    w = (torch.randn(HEAD_V, HEAD_D, generator=g) * (3 / HEAD_D**0.5)).to(dtype).requires_grad_(not frozen_weight)
    x2 = torch.randn(HEAD_T, HEAD_R, generator=g).to(dtype).requires_grad_(True) if extra else None
    w2 = (torch.randn(HEAD_V, HEAD_R, generator=g) * 0.3).to(dtype).requires_grad_(True) if extra else None
    target = head_target(form, dtype, g) if form else None
    labels = torch.randint(0, HEAD_V, (HEAD_T,), generator=g)
    weights = [torch.rand(HEAD_T, generator=g) for _ in range(3)]
    return x, w, x2, w2, target, labels, weights


def run_head_loss(mode: str, inputs, *, soft: bool, ce: bool, l1: bool):
    x, w, x2, w2, target, labels, (ws, wc, wl) = inputs
    leaves = [t for t in (x, w, x2, w2) if t is not None and t.requires_grad]
    for t in leaves:
        t.grad = None
    out = head_loss(
        x,
        w,
        target=target,
        labels=labels if ce else None,
        w_soft=ws if soft else None,
        w_ce=wc if ce else None,
        w_l1=wl if l1 else None,
        extra=(x2, w2) if x2 is not None else None,
        chunk_rows=HEAD_CHUNK_ROWS,
        block_v=HEAD_BLOCK_V,
        mode=mode,
    )
    out.loss.backward()
    return out, [t.grad.clone() for t in leaves]


def compare_head_loss(ref, fused, dtype: torch.dtype) -> None:
    (r_out, r_grads), (f_out, f_grads) = ref, fused
    # Loss terms are fp32 sums over identical logits whatever the input dtype.
    assert_close(f_out.loss, r_out.loss, **FP32)
    for name in ("soft_ce", "ce", "l1"):
        r, f = getattr(r_out, name), getattr(f_out, name)
        assert (r is None) == (f is None), name
        if r is not None:
            assert_close(f, r, **FP32, msg=name)
    for name in ("acc", "hit"):
        r, f = getattr(r_out, name), getattr(f_out, name)
        assert (r is None) == (f is None), name
        if r is not None:
            assert torch.equal(f, r), name
    grad_tol = HEAD_GRAD[str(dtype).removeprefix("torch.")]
    for i, (r, f) in enumerate(zip(r_grads, f_grads, strict=True)):
        assert f.dtype == r.dtype and not f.isnan().any(), f"grad {i}"
        scale = float(r.float().abs().max())
        assert_close(f.float(), r.float(), rtol=grad_tol["rtol"], atol=grad_tol["atol"] * scale, msg=f"grad {i}")
