"""Serve a target with (or without) an exported drafter in vLLM and report outputs and spec-decode metrics.

Serving runs under a vLLM environment (`.venv-vllm` on CPU, the GPU image's Python on GPU) and imports
nothing from draftsmith. It prints one JSON object on the last line: `{"method", "draft", "outputs":
[[token ids]...], "seconds", "output_tokens", "metrics": {num_drafts, num_draft_tokens, num_accepted_tokens,
accepted_per_pos}}` (metrics are zeros without a drafter). `--method`/`--num-tokens` default to what the
draft's config.json says (EAGLE-3: the trained depth; DFlash: block - 1; DSpark: block).

    python benchmarks/workers/gpu_serve_check.py --target T [--draft D [--method M --num-tokens N]]
    python benchmarks/workers/gpu_serve_check.py --make-drafts DIR --target T   # random drafters (needs draftsmith)
    python benchmarks/workers/gpu_serve_check.py --summarise REPORTS.jsonl       # table + identical-output check
"""

import argparse
import json
import os
import sys
import time
from typing import Any

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "List three prime numbers and explain why they are prime."}],
    [{"role": "user", "content": "Translate 'good morning' into Spanish."}],
]
_METRICS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}


def _combine(a: list[int], b: list[int], sign: int) -> list[int]:
    """Element-wise `a + sign * b`, the shorter list padded with zeros."""
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + sign * (int(b[i]) if i < len(b) else 0) for i in range(n)]


def spec_metrics(llm) -> dict:
    """The spec-decode counters summed over label sets (engine replicas)."""
    counts = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
    per_pos: list[int] = []
    for m in llm.get_metrics():
        if m.name in _METRICS:
            counts[_METRICS[m.name]] += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            per_pos = _combine(per_pos, list(m.values), 1)
    return {**counts, "accepted_per_pos": per_pos}


def draft_method(folder: str) -> tuple[str, int]:
    """`(method, num_speculative_tokens)` from an exported draft's config.json."""
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    arch = (config.get("architectures") or [""])[0]
    meta = config.get("draftsmith") or {}
    if "Eagle3" in arch:
        return "eagle3", int(meta.get("ttt_depth") or 3)
    if "DSpark" in arch:
        return "dspark", int(config["block_size"])
    if "DFlash" in arch:
        return "dflash", int(config.get("block_size") or config["dflash_config"]["block_size"]) - 1
    raise SystemExit(f"{folder}/config.json: unknown draft architecture {arch!r}")


def _random_init(model, embed, head) -> None:
    """Small random matrices, unit norms, and the target's embedding (and head where the drafter shares it)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1 and name not in ("embed_tokens.weight", "lm_head.weight"):
                p.normal_(0, 0.02)
        model.embed_tokens.weight.copy_(embed)
        if model.lm_head.weight.shape == head.shape:
            model.lm_head.weight.copy_(head)


def _random_models(cfg: dict) -> dict:
    """`{name: (method, untrained drafter)}` shaped for the target config `cfg`."""
    from draftsmith.drafters.dflash import DFlashDrafter, DFlashSpec
    from draftsmith.drafters.eagle3.model import Eagle3Drafter, Eagle3Spec

    H, V, heads = cfg["hidden_size"], cfg["vocab_size"], cfg["num_attention_heads"]
    common: dict[str, Any] = {
        "hidden_size": H,
        "target_hidden_size": H,
        "num_taps": 3,
        "num_heads": heads,
        "num_kv_heads": cfg.get("num_key_value_heads") or heads,
        "head_dim": cfg.get("head_dim") or H // heads,
        "intermediate_size": cfg["intermediate_size"],
        "vocab_size": V,
        "rope_theta": float(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 1e4)),
        "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
    }
    block: dict[str, Any] = {"num_layers": 1, "block_size": 4, "mask_token_id": 0}
    conv: dict[str, Any] = {"conv_kernel_size": 2, "conv_group_size": 64, "selector_rank": 32, "selector_top_k": 8}
    models = {
        "eagle3": ("eagle3", Eagle3Drafter(Eagle3Spec(**common, draft_vocab_size=V))),
        "dflash": ("dflash", DFlashDrafter(DFlashSpec(**common, **block))),
        "dflash2": ("dflash", DFlashDrafter(DFlashSpec(**common, **block, **conv))),
    }
    from draftsmith.drafters.dspark.model import DSparkDrafter, DSparkSpec

    models["dspark"] = ("dspark", DSparkDrafter(DSparkSpec(**common, **block, markov_rank=32)))
    return models


def make_drafts(target: str, out: str) -> None:
    """Export random drafters for `target` under `out/<name>` (run from the repo root in the project venv)."""
    import torch

    from draftsmith.drafters.export import bundle

    with open(os.path.join(target, "config.json")) as f:
        cfg = json.load(f)
    cfg = cfg.get("text_config") or cfg
    L = cfg["num_hidden_layers"]
    taps = [2, L // 2, L - 3]  # vLLM's default EAGLE-3 aux layers
    embed, head = bundle.target_weights(target)
    meta = {"max_position_embeddings": cfg.get("max_position_embeddings"), "ttt_depth": 3}
    torch.manual_seed(0)
    for name, (method, model) in _random_models(cfg).items():
        _random_init(model, embed, head)
        if method == "eagle3":
            model.t2d.fill_(True)  # full vocabulary: d2t offsets stay zero
        blobs = bundle.export_drafter(
            method, model, taps, meta, engine="vllm", num_target_layers=L, target_embed_VH=embed
        )
        print(f"{name}: {bundle.write_folder(os.path.join(out, name), blobs)}")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", help="target model folder")
    p.add_argument("--draft", help="exported drafter folder (omit for the no-spec baseline)")
    p.add_argument("--method", choices=["eagle3", "dflash", "dspark"], help="speculative method of --draft")
    p.add_argument("--num-tokens", type=int, help="num_speculative_tokens")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--make-drafts", metavar="DIR", help="write random eagle3/dflash/dflash2/dspark drafts for --target")
    p.add_argument("--summarise", metavar="JSONL", help="print a table of driver reports (first = baseline)")
    return p.parse_args(argv)


def serve(args: argparse.Namespace) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    from vllm import LLM, SamplingParams

    kwargs = {"dtype": args.dtype, "max_model_len": args.max_model_len, "max_num_seqs": 8, "seed": 0}
    kwargs |= {"disable_log_stats": False, "enforce_eager": args.enforce_eager}
    method = "none"
    if args.draft:
        method, num_tokens = draft_method(args.draft)
        method, num_tokens = args.method or method, args.num_tokens or num_tokens
        kwargs["speculative_config"] = {"method": method, "model": args.draft, "num_speculative_tokens": num_tokens}
    llm = LLM(model=args.target, **kwargs)
    llm.chat(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=2))  # warm-up, outside the timing
    before = spec_metrics(llm)
    t0 = time.perf_counter()
    results = llm.chat(PROMPTS, SamplingParams(temperature=0.0, max_tokens=args.max_tokens))
    seconds = time.perf_counter() - t0
    after = spec_metrics(llm)
    metrics = {k: after[k] - before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    metrics["accepted_per_pos"] = _combine(after["accepted_per_pos"], before["accepted_per_pos"], -1)
    outputs = [list(r.outputs[0].token_ids) for r in results]
    return {
        "method": method,
        "draft": args.draft,
        "outputs": outputs,
        "seconds": round(seconds, 3),
        "output_tokens": sum(len(o) for o in outputs),
        "metrics": metrics,
    }


def summarise(path: str) -> int:
    """Print one row per report; exit 1 if any drafter changed the output or drafted nothing."""
    with open(path) as f:
        reports = [json.loads(line) for line in f if line.strip()]
    base, bad = reports[0], 0
    print(f"{'draft':<44}{'tok/s':>8}{'drafts':>8}{'accepted':>10}{'acc_len':>9}  same_output  per_pos")
    for r in reports:
        m = r["metrics"]
        same = r["outputs"] == base["outputs"]
        acc_len = 1 + m["num_accepted_tokens"] / m["num_drafts"] if m["num_drafts"] else float("nan")
        name = f"{r['method']}:{os.path.basename(r['draft'] or '') or '-'}"
        print(
            f"{name:<44}{r['output_tokens'] / r['seconds']:>8.1f}{m['num_drafts']:>8}{m['num_accepted_tokens']:>10}"
            f"{acc_len:>9.3f}  {str(same):<11}  {m['accepted_per_pos']}"
        )
        bad += (not same) or (r["method"] != "none" and m["num_drafts"] == 0)
    return 1 if bad else 0


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.summarise:
        return summarise(args.summarise)
    if not args.target:
        raise SystemExit("--target is required")
    if args.make_drafts:
        make_drafts(args.target, args.make_drafts)
        return 0
    print(json.dumps(serve(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
