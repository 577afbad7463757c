"""Driver of `benchmarks/gpu_kernels.sh`: each Triton kernel against its PyTorch reference (eager) and
`torch.compile` of that reference, forward + backward: median time, peak memory and a parity check.

Ops: `head_eagle3` (soft CE against the target's distribution from its last hidden state and head),
`head_dspark` (CE + L1 with the low-rank Markov term), `rms_norm` (3-tap `fc_norm` over `[T, 3H]`) and
`dyn_conv` (DFlash2's two-tap conv, groups of 16, blocks of 8). Default shapes: Kimi K3 (H 7168, V 163840,
T 8192), bf16. `--smoke`: tiny shapes on CPU under TRITON_INTERPRET=1, fp32, compile backend `eager`.

Needs only torch, triton and this repository's `kernels` package. Prints a line per (op, impl), a markdown
table and a JSON line; exit status 1 when a case failed, was skipped for time, or missed parity.
"""

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="Tiny shapes on CPU under the Triton interpreter.")
    p.add_argument("--T", type=int, default=8192, help="Rows (tokens).")
    p.add_argument("--H", type=int, default=7168, help="Hidden width.")
    p.add_argument("--V", type=int, default=163840, help="Output vocabulary.")
    p.add_argument("--rank", type=int, default=256, help="Markov rank of head_dspark.")
    p.add_argument("--ops", default="head_eagle3,head_dspark,rms_norm,dyn_conv", help="Comma-separated ops.")
    p.add_argument("--repeats", type=int, default=3, help="Timed runs per case (after one warm-up).")
    p.add_argument("--budget-s", type=float, default=420.0, help="Start no new op after this many seconds.")
    p.add_argument(
        "--chunk-rows", default="", help="Comma-separated row-chunk sizes to time the head-loss kernel at as well."
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.T, args.H, args.V, args.rank, args.repeats = 63, 64, 300, 8, 1
    return args


def _inputs(op: str, a, torch, dev, dtype):
    """Leaves needing gradients, the other inputs, and the upstream gradient (for non-scalar outputs)."""
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape, scale=1.0, grad=False, dt=dtype):
        t = (torch.randn(*shape, generator=g, device=dev) * scale).to(dt)
        return t.requires_grad_(grad)

    T, H, V = a.T, a.H, a.V
    if op.startswith("head"):
        leaves = {"x": rand(T, H, grad=True), "w": rand(V, H, scale=3 / H**0.5, grad=True)}
        other = {"th": rand(T, H), "tw": rand(V, H, scale=3 / H**0.5)}
        if op == "head_dspark":
            leaves |= {"x2": rand(a.T, a.rank, grad=True), "w2": rand(V, a.rank, scale=0.1, grad=True)}
            other["labels"] = torch.randint(0, V, (T,), generator=g, device=dev)
        return leaves, other, None
    if op == "rms_norm":
        return (
            {"x": rand(T, 3 * H, grad=True), "w": rand(3, H, scale=0.1, dt=torch.float32, grad=True)},
            {},
            rand(T, 3 * H),
        )
    groups = H // 16 if not a.smoke else H // 8
    leaves = {"x": rand(1, T, H, grad=True), "base": rand(2, H, grad=True), "delta": rand(1, T, 2, groups, grad=True)}
    return leaves, {}, rand(1, T, H)


def _error(e: BaseException) -> str:
    """The error and its cause, tail kept: a Triton CompilationError names the real problem last, in its cause."""
    text = f"{type(e).__name__}: {e}"
    if e.__cause__ is not None:
        text += f" <- {type(e.__cause__).__name__}: {e.__cause__}"
    return text if len(text) <= 1500 else text[:300] + " ... " + text[-1200:]


def _fns(op: str, a, torch, kernels_mod):
    """`{impl: fn(leaves, other) -> output}` for reference, compiled reference and triton."""
    from draftsmith.kernels.dyn_conv import dyn_conv, dyn_conv_reference
    from draftsmith.kernels.head_loss import Target, head_loss, head_loss_reference
    from draftsmith.kernels.head_loss.spec import row_weights
    from draftsmith.kernels.rmsnorm import rms_norm, rms_norm_reference

    eps, block = 1e-6, 8
    if op.startswith("head"):
        dspark = op == "head_dspark"

        def weights(x):
            T = x.shape[0]
            share = torch.full((T,), 1.0 / T, device=x.device)
            return (None, 0.1 * share, 0.9 * share) if dspark else (share, None, None)

        def ref(lv, ot):
            target = Target(hidden=ot["th"], head=ot["tw"])
            w3 = row_weights(lv["x"].shape[0], lv["x"].device, *weights(lv["x"]))
            extra = (lv["x2"], lv["w2"]) if dspark else (None, None)
            return head_loss_reference(lv["x"], lv["w"], target, ot.get("labels"), w3, dspark, *extra).loss

        def tri_head(lv, ot, chunk_rows=None):
            ws, wc, wl = weights(lv["x"])
            return head_loss(
                lv["x"], lv["w"], target=Target(hidden=ot["th"], head=ot["tw"]), labels=ot.get("labels"),
                w_soft=ws, w_ce=wc, w_l1=wl, extra=(lv["x2"], lv["w2"]) if dspark else None,
                chunk_rows=chunk_rows, mode="triton",
            ).loss  # fmt: skip

        chunked = {f"triton-c{n}": functools.partial(tri_head, chunk_rows=int(n)) for n in a.chunk_rows.split(",") if n}
        tri: Callable[..., Any] = tri_head
    elif op == "rms_norm":

        def ref(lv, ot):
            return rms_norm_reference(lv["x"], lv["w"], eps)

        def tri_norm(lv, ot):
            return rms_norm(lv["x"], lv["w"], eps, mode="triton")

        tri = tri_norm
    else:

        def ref(lv, ot):
            x = lv["x"]
            T, H = x.shape[1], x.shape[2]
            return dyn_conv_reference(x.view(T, H), lv["base"], lv["delta"].view(T, 2, -1), block, T).view(1, T, H)

        def tri_conv(lv, ot):
            return dyn_conv(lv["x"], lv["base"], lv["delta"], block, mode="triton")

        tri = tri_conv

    compiled = torch.compile(ref, backend="eager" if a.smoke else "inductor", dynamic=False)
    return {"reference": ref, "compiled": compiled, "triton": tri, **(chunked if op.startswith("head") else {})}


def _step(fn, leaves, other, dy):
    for t in leaves.values():
        t.grad = None
    out = fn(leaves, other)
    if dy is None:
        out.backward()
    else:
        out.backward(dy)
    return out


def _measure(torch, dev, fn, leaves, other, dy, repeats):
    cuda = dev.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    _step(fn, leaves, other, dy)  # warm-up: compiles and autotunes
    sync()
    for t in leaves.values():
        t.grad = None
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        out = _step(fn, leaves, other, dy)
        sync()
        times.append(time.perf_counter() - t0)
        del out
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else float("nan")
    return statistics.median(times) * 1e3, peak


def _parity(torch, fns, leaves, other, dy) -> float:
    """Largest relative L2 difference (output and every gradient), triton vs eager reference."""
    got = {}
    for impl in ("reference", "triton"):
        out = _step(fns[impl], leaves, other, dy)
        got[impl] = [out.detach().float()] + [t.grad.float() for t in leaves.values()]
    worst = 0.0
    for a, b in zip(got["triton"], got["reference"], strict=True):
        worst = max(worst, float((a - b).norm() / b.norm().clamp(min=1e-30)))
    return worst


PARITY = {"float32": 1e-4, "bfloat16": 2e-2}  # relative L2; bf16: one rounding of dloss/dz before the matmuls


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import
    import torch

    from draftsmith import kernels

    dev = torch.device("cpu" if a.smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if a.smoke else torch.bfloat16
    print(f"kernels benchmark: device={dev} ({torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}) "
          f"dtype={dtype} T={a.T} H={a.H} V={a.V} torch={torch.__version__}", flush=True)  # fmt: skip
    start, rows, failed = time.time(), [], []
    for op in a.ops.split(","):
        if time.time() - start > a.budget_s:
            print(f"{op}: SKIPPED (budget {a.budget_s:.0f}s spent)", flush=True)
            failed.append(f"{op}: skipped")
            continue
        leaves, other, dy = _inputs(op, a, torch, dev, dtype)
        fns = _fns(op, a, torch, kernels)
        results = {}
        for impl, fn in fns.items():
            try:
                results[impl] = _measure(torch, dev, fn, leaves, other, dy, a.repeats)
            except Exception as e:  # one failing case must not hide the others' figures
                print(f"{op} {impl}: ERROR {_error(e)}", flush=True)
                failed.append(f"{op} {impl}: {type(e).__name__}")
                continue
            ms, gib = results[impl]
            print(f"{op} {impl}: {ms:.2f} ms, peak {gib:.3f} GiB", flush=True)
        try:
            err = _parity(torch, fns, leaves, other, dy)
        except Exception as e:
            err = float("inf")
            print(f"{op} parity: ERROR {_error(e)}", flush=True)
        ok = err <= PARITY[str(dtype).removeprefix("torch.")]
        print(f"{op} parity (relative L2, triton vs reference): {err:.2e} {'ok' if ok else 'FAIL'}", flush=True)
        if not ok:
            failed.append(f"{op}: parity {err:.2e}")
        rows.append({"op": op, "parity": err, **{k: {"ms": v[0], "peak_gib": v[1]} for k, v in results.items()}})
        del leaves, other, dy, fns
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    _report(rows)
    print(json.dumps({"kernels_benchmark": rows, "failed": failed, "T": a.T, "H": a.H, "V": a.V}), flush=True)
    return 1 if failed else 0


def _report(rows) -> None:
    print("\n| op | impl | ms | peak GiB | time vs ref | time vs compiled | memory: ref/this | compiled/this |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        ref, comp = r.get("reference"), r.get("compiled")
        for impl in ("reference", "compiled", "triton", *sorted(k for k in r if k.startswith("triton-c"))):
            if impl not in r:
                continue
            m = r[impl]

            def ratio(x, y):
                return f"{x / y:.2f}" if x and y and y == y and x == x else "n/a"

            print(
                f"| {r['op']} | {impl} | {m['ms']:.2f} | {m['peak_gib']:.3f} "
                f"| {ratio(m['ms'], ref and ref['ms'])} | {ratio(m['ms'], comp and comp['ms'])} "
                f"| {ratio(ref and ref['peak_gib'], m['peak_gib'])} "
                f"| {ratio(comp and comp['peak_gib'], m['peak_gib'])} |"
            )
    for r in rows:
        measured = "triton" in r and "compiled" in r and r["triton"]["peak_gib"] == r["triton"]["peak_gib"]
        if r["op"].startswith("head") and measured:  # no goal on CPU (no peak memory figure there)
            t, c = r["triton"], r["compiled"]
            mem_ok = c["peak_gib"] >= 2 * t["peak_gib"]
            speed_ok = t["ms"] <= c["ms"]
            print(f"{r['op']} goal (>= 2x less memory than compiled, at equal or better speed): "
                  f"memory {'met' if mem_ok else 'missed'}, speed {'met' if speed_ok else 'missed'}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
