"""Named tolerances of the kernel parity tests, each with the reason it is what it is.

`torch.testing.assert_close` keyword sets (rtol, atol).
"""

# fp32 on both sides, same formulas: only the summation order differs (per-lane online softmax and tiled
# sums in the kernel, torch's reductions in the reference), a few fp32 ulps on values of order 1-10.
FP32 = {"rtol": 2e-5, "atol": 2e-5}

# Head loss with fp16 / bf16 inputs: the logits come from the very same torch matmul on both sides and every
# softmax sum is fp32, so the loss terms agree like fp32 ones. Gradients pass through one cast of dloss/dz to
# the input dtype before the gradient matmuls on both sides; an fp32 difference of a few ulps can flip that
# rounding, so a gradient element may differ by one ulp of the dtype (fp16 2^-10, bf16 2^-7), in relative
# terms of the largest contributing product: hence an atol scaled by the gradient's magnitude.
HEAD_GRAD = {"float32": {"rtol": 1e-4, "atol": 1e-5}, "float16": {"rtol": 2e-3, "atol": 2e-3}}
HEAD_GRAD["bfloat16"] = {"rtol": 1.6e-2, "atol": 1.6e-2}

# Elementwise kernels (RMSNorm, dyn conv) on fp16 / bf16 inputs, compared with the reference run in fp32 on
# the same (upcast) inputs and cast back: the kernel also computes in fp32, so the one difference is the final
# store. fp16 stores round (half an ulp, 2^-11 relative); the Triton interpreter's bf16 stores truncate instead
# of rounding, so up to one full bf16 ulp (2^-7 relative, 2^-8 for the rounded reference).
STORE = {"float16": {"rtol": 1e-3, "atol": 1e-3}, "bfloat16": {"rtol": 8e-3, "atol": 8e-3}}
