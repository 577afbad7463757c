"""Compile the Triton kernels for a GPU architecture on a machine without one.

Triton's CPU interpreter runs a kernel's Python body, so it accepts code that the real compiler refuses (a
global read from a jitted function that is not a `tl.constexpr`, a loop-carried value changing type, ...).
The compiler itself needs no GPU: `triton.compile` with an explicit `GPUTarget` lowers a kernel to PTX and
a cubin with the `ptxas` that triton's wheel ships. So the tests record every launch the interpreter runs
(`recording`: the kernel, its argument types and its constexpr values) and compile each one for the GPUs
the recipes train on, in a process without the interpreter (it patches `triton.language` for good once it
has run): `python -m draftsmith.kernels.gpu_compile` reads the launches as JSON on stdin and prints one JSON
result per launch.
"""

import contextlib
import importlib
import json
import sys
from collections.abc import Iterator
from typing import Any

import torch

# sm_90: H100/H200; sm_100: B200/GB200.
ARCHS: tuple[int, ...] = (90, 100)
_POINTEE = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "i1",
}


def _arg_type(name: str, value: Any) -> str:
    """Triton's signature type of a runtime argument, as its launcher specialises it."""
    if isinstance(value, torch.Tensor):
        if value.dtype not in _POINTEE:
            raise TypeError(f"kernel argument {name}: no triton pointer type for {value.dtype}")
        return "*" + _POINTEE[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"kernel argument {name}: cannot type a {type(value).__name__}")


def launch_record(fn: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """`{"kernel": "module:name", "signature": {param: type}, "constexprs": {param: value}}` of one launch.

    `fn` is the launched `JITFunction` or interpreter function (either has `.fn`, the Python function).
    """
    py = fn.fn
    names = list(py.__code__.co_varnames[: py.__code__.co_argcount])
    bound = dict(zip(names, args, strict=False)) | kwargs
    constexpr = set(_constexpr_params(py))
    signature, constexprs = {}, {}
    for name in names:
        if name in constexpr:
            signature[name], constexprs[name] = "constexpr", bound[name]
        else:
            signature[name] = _arg_type(name, bound[name])
    return {"kernel": f"{py.__module__}:{py.__qualname__}", "signature": signature, "constexprs": constexprs}


def _constexpr_params(py: Any) -> list[str]:
    import triton.language as tl

    annotations = getattr(py, "__annotations__", {})
    return [name for name, ann in annotations.items() if ann is tl.constexpr or ann == "tl.constexpr"]


@contextlib.contextmanager
def recording() -> Iterator[list[dict[str, Any]]]:
    """Record each kernel launch the interpreter runs in the block (distinct launches only, in order)."""
    from triton.runtime.interpreter import InterpretedFunction

    launches: list[dict[str, Any]] = []
    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        record = launch_record(self, args, kwargs)
        if record not in launches:
            launches.append(record)
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run
    try:
        yield launches
    finally:
        InterpretedFunction.run = original


def compile_launch(record: dict[str, Any], arch: int) -> dict[str, Any]:
    """Compile one recorded launch for `sm_<arch>`: `{"kernel", "arch", "ok", "error", "stages"}`."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, _, name = record["kernel"].partition(":")
    fn = getattr(importlib.import_module(module), name)
    order = list(record["signature"])
    constexprs = {(order.index(k),): v for k, v in record["constexprs"].items()}
    out = {"kernel": record["kernel"], "arch": arch, "constexprs": record["constexprs"]}
    try:
        compiled = triton.compile(
            ASTSource(fn, signature=record["signature"], constexprs=constexprs), target=GPUTarget("cuda", arch, 32)
        )
    except Exception as err:  # a compile error of any kind is the finding, reported per launch
        cause = err.__cause__ or err
        return out | {"ok": False, "error": f"{type(cause).__name__}: {cause}".strip()}
    return out | {"ok": True, "error": None, "stages": sorted(compiled.asm)}


def main() -> int:
    from draftsmith.kernels import dispatch

    if dispatch.interpreting():
        sys.stderr.write("gpu_compile: TRITON_INTERPRET=1 is set; the compiler needs it unset\n")
        return 2
    launches = json.load(sys.stdin)
    failed = 0
    for record in launches:
        for arch in ARCHS:
            result = compile_launch(record, arch)
            failed += not result["ok"]
            sys.stdout.write(json.dumps(result) + "\n")  # one line per launch and arch, for the caller to read
            sys.stdout.flush()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
