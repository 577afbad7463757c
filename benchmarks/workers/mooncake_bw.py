"""Mooncake put+get bandwidth on one host (TCP) against a local memcpy of the same hidden-state chunks.

The layout is the stream's: a producer client that lends no memory puts bf16 `[S, N*H]` chunks (4 MiB each)
from a registered buffer with `batch_put_from` (hard-pinned) into a consumer client's segment; the consumer
gets them with `batch_get_into` and force-removes them. `mooncake_MBps` is chunk bytes over put + get time;
`memcpy_MBps` is `Tensor.copy_` of the same chunks into preallocated tensors.

Run: `.venv/bin/python -m benchmarks.workers.mooncake_bw [total_mb]`.
"""

import json
import sys
import time

import torch

from draftsmith.transport.mooncake_store import MooncakeMaster, connect

SEQ, WIDTH = 512, 4096  # one chunk: S=512 tokens of N*H=4096 bf16 features = 4 MiB


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _check(rcs: list[int], want, what: str) -> None:
    bad = [(i, rc) for i, rc in enumerate(rcs) if rc != want]
    if bad:
        raise RuntimeError(f"{what} failed for chunk {bad[0][0]}: rc={bad[0][1]}")


def _mooncake_seconds(producer, consumer, src: torch.Tensor, dst: torch.Tensor, chunk: int, rounds: int):
    """Best (put, get) seconds over `rounds` rounds of put-all, get-all, remove-all."""
    from mooncake.store import ReplicateConfig

    cfg = ReplicateConfig()
    cfg.with_hard_pin = True
    n = src.numel() // chunk
    sizes = [chunk] * n
    best_put = best_get = float("inf")
    for r in range(rounds):
        keys = [f"bw/{r}/{i}" for i in range(n)]
        src_ptrs = [src.data_ptr() + i * chunk for i in range(n)]
        dst_ptrs = [dst.data_ptr() + i * chunk for i in range(n)]
        t0 = time.perf_counter()
        _check(producer.batch_put_from(keys, src_ptrs, sizes, cfg), 0, "batch_put_from")
        t1 = time.perf_counter()
        _check(consumer.batch_get_into(keys, dst_ptrs, sizes), chunk, "batch_get_into")
        t2 = time.perf_counter()
        _check(consumer.batch_remove(keys, True), 0, "batch_remove")
        best_put, best_get = min(best_put, t1 - t0), min(best_get, t2 - t1)
    if not torch.equal(src, dst):
        raise RuntimeError("bytes read back from Mooncake differ from the bytes put")
    return best_put, best_get


def mooncake_vs_memcpy(total_mb: int = 256, rounds: int = 3) -> dict:
    """Put+get MB/s through a real local master vs `Tensor.copy_` MB/s for `total_mb` of 4 MiB bf16 chunks."""
    chunk = SEQ * WIDTH * 2
    n = max(1, total_mb * (1 << 20) // chunk)
    src_chunks = torch.randn(n, SEQ, WIDTH).to(torch.bfloat16)
    src = src_chunks.view(-1).view(torch.uint8)
    dst = torch.zeros_like(src)
    with MooncakeMaster() as master:
        consumer = connect(master.settings(global_segment_bytes=n * chunk + (64 << 20), local_buffer_bytes=16 << 20))
        producer = connect(master.settings(global_segment_bytes=0, local_buffer_bytes=16 << 20))
        try:
            for store, buf in ((producer, src), (consumer, dst)):
                _check([store.register_buffer(buf.data_ptr(), buf.numel())], 0, "register_buffer")
            t_put, t_get = _mooncake_seconds(producer, consumer, src, dst, chunk, rounds)
            for store, buf in ((producer, src), (consumer, dst)):
                store.unregister_buffer(buf.data_ptr())
        finally:
            producer.close()
            consumer.close()
    copies = [torch.empty_like(c) for c in src_chunks]
    t_copy = min(_timed(lambda: [d.copy_(c) for d, c in zip(copies, src_chunks, strict=True)]) for _ in range(rounds))
    mb = n * chunk / (1 << 20)
    out = {
        "total_mb": mb,
        "chunk_mb": chunk / (1 << 20),
        "put_MBps": mb / t_put,
        "get_MBps": mb / t_get,
        "mooncake_MBps": mb / (t_put + t_get),
        "memcpy_MBps": mb / t_copy,
    }
    out["ratio"] = out["mooncake_MBps"] / out["memcpy_MBps"]
    return out


if __name__ == "__main__":
    result = mooncake_vs_memcpy(int(sys.argv[1]) if len(sys.argv) > 1 else 256)
    print(json.dumps({k: round(v, 3) for k, v in result.items()}, indent=1))
