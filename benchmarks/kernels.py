"""Peak memory of the chunked reference head loss vs the naive full-logits loss, on CPU, side by side.

The EAGLE-3 form (soft cross-entropy against the target's distribution made from its last hidden state and
head), forward + backward, T = 2048 rows, H = 128 (moderate so the run stays under ~2 minutes on 2 cores;
the `[T, V]` buffers that decide the figure do not depend on H), V = 49152 (SmolLM2) and 163840 (Kimi K3).
Naive: `head_loss_reference(chunk_rows=None)`, all `[T, V]` logits alive through backward. Chunked: the
default row chunks (`draftsmith.kernels.head_loss.chunk_rows_for`, what CPU training runs), each checkpointed.

Each case runs in its own process; its peak is the rise of the resident set's high-water mark (VmHWM, reset
through /proc/self/clear_refs once the inputs exist) over the resident set before the loss.
Prints a table and the chunked / naive ratio per vocabulary.

Run: `python -m benchmarks.kernels` (part of `make bench`); `--case naive|chunked --vocab V` runs one case.
"""

import argparse
import json
import subprocess
import sys
import time

import torch

T, H, VOCABS = 2048, 128, (49152, 163840)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def run_case(case: str, V: int) -> dict:
    """One forward + backward in this process: its peak memory rise (MiB) and time (s)."""
    from draftsmith.kernels.head_loss import Target, chunk_rows_for, head_loss_reference
    from draftsmith.kernels.head_loss.spec import row_weights

    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g).requires_grad_(True)
    w = (torch.randn(V, H, generator=g) / H**0.5).requires_grad_(True)
    target = Target(hidden=torch.randn(T, H, generator=g), head=torch.randn(V, H, generator=g) / H**0.5)
    w3 = row_weights(T, x.device, torch.full((T,), 1.0 / T), None, None)
    rows = None if case == "naive" else chunk_rows_for(V)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    base = _status_kib("VmRSS")
    t0 = time.perf_counter()
    out = head_loss_reference(x, w, target, None, w3, False, chunk_rows=rows)
    out.loss.backward()
    seconds = time.perf_counter() - t0
    peak = _status_kib("VmHWM") - base
    return {
        "case": case,
        "V": V,
        "chunk_rows": rows or T,
        "peak_mib": peak / 1024,
        "s": seconds,
        "loss": float(out.loss),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=["naive", "chunked"], help="Run one case here and print its JSON.")
    parser.add_argument("--vocab", type=int, default=VOCABS[0], help="V of --case.")
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case, args.vocab)))
        return
    results = {}
    for V in VOCABS:
        for case in ("naive", "chunked"):
            cmd = [sys.executable, "-m", "benchmarks.kernels", "--case", case, "--vocab", str(V)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            results[case, V] = json.loads(out.strip().splitlines()[-1])
    print(f"head loss (EAGLE-3 soft CE), T={T}, H={H}, fp32, forward + backward, CPU")
    print(f"{'V':>7} {'case':>8} {'rows/chunk':>10} {'peak MiB':>9} {'time s':>7} {'loss':>9}")
    for (case, V), r in results.items():
        print(f"{V:>7} {case:>8} {r['chunk_rows']:>10} {r['peak_mib']:>9.0f} {r['s']:>7.2f} {r['loss']:>9.5f}")
    for V in VOCABS:
        naive, chunked = results["naive", V], results["chunked", V]
        if abs(naive["loss"] - chunked["loss"]) > 1e-4 * abs(naive["loss"]):
            raise SystemExit(f"V={V}: chunked loss {chunked['loss']} differs from naive {naive['loss']}")
        ratio = chunked["peak_mib"] / naive["peak_mib"]
        print(f"V={V}: peak memory chunked / naive = {ratio:.3f} ({1 / ratio:.1f}x less)")


if __name__ == "__main__":
    main()
