"""Tokenize-stage throughput on 20K synthetic conversations with SmolLM2's tokenizer, 2 workers.

Prints (1) the stage's rows/s over a raw batch `tokenizer(texts)` on the same rendered texts (the limit:
no rendering, no masks, no files) and (2) the stage over a naive version: the pool made after the corpus
is loaded, one conversation per job with per-call renders, torch tensors sent back.

Fair conditions: the stage's workers tokenize single-threaded (TOKENIZERS_PARALLELISM=false, one process
per core), so the raw limit is measured with the Rust thread pool on, capped at the same number of
threads (RAYON_NUM_THREADS=workers). The machine may be shared, so the stage runs twice and the raw call
three times, best of each; the stage's time includes starting its workers and loading the tokenizer.

    .venv/bin/python benchmarks/tokenize_stage.py [--rows 20000] [--workers 2]
"""

import argparse
import json
import multiprocessing as mp
import os
import random
import tempfile
import time
from typing import Any

WORDS = (
    "the model answers each question with a short derivation and then states the result clearly so that a "
    "reader can check every step of the reasoning against the original problem statement and its numbers"
).split()


def conversations(n: int, seed: int = 0) -> list[dict]:
    """Synthetic prompts with fake assistant answers of 150-700 characters, multi-turn where the pool is."""
    from draftsmith.tasks.prompt_pool import synthetic_pool

    rng = random.Random(seed)
    rows = []
    for rec in synthetic_pool(n, seed=seed):
        messages = [{"role": "system", "content": rec.system}] if rec.system else []
        for turn in rec.turns:
            answer = " ".join(rng.choice(WORDS) for _ in range(rng.randint(25, 120)))
            messages += [{"role": "user", "content": turn}, {"role": "assistant", "content": answer.capitalize()}]
        rows.append({"id": rec.id, "category": rec.category, "messages": messages, "finish": ["stop"]})
    return rows


def write_corpus(rows: list[dict], folder: str, shard_rows: int = 1000):
    from draftsmith.core import storage
    from draftsmith.core.manifest import FileEntry, StageManifest

    files = []
    for k in range(0, len(rows), shard_rows):
        data = "".join(json.dumps(r) + "\n" for r in rows[k : k + shard_rows]).encode()
        name = f"conversations-{k // shard_rows:05d}.jsonl"
        storage.write_bytes(f"{folder}/{name}", data)
        files.append(FileEntry(name=name, bytes=len(data), digest=storage.sha256(data), algo="sha256"))
    return StageManifest(stage="regenerate", key="bench", uri=folder, files=files)


_NAIVE_TOK = None


def _naive_init(path: str) -> None:
    global _NAIVE_TOK
    import torch.multiprocessing
    from transformers import AutoTokenizer

    # The default fd-passing strategy runs out of descriptors on tens of thousands of returned tensors.
    torch.multiprocessing.set_sharing_strategy("file_system")

    _NAIVE_TOK = AutoTokenizer.from_pretrained(path)


def _naive_job(messages: list[dict]):
    """The first version's worker: renders per call, one conversation, tensors back."""
    import torch

    from draftsmith.tasks.token_encode import encode

    assert _NAIVE_TOK is not None, "set by the pool's initializer"
    e = encode(_NAIVE_TOK, messages, max_length=4096, last_turn_only=False)
    assert e is not None, "4096 tokens hold every synthetic conversation"
    return torch.from_numpy(e.input_ids.copy()), torch.from_numpy(e.loss_mask.copy())


def naive(manifest, tok_path: str, workers: int) -> float:
    import torch.multiprocessing

    from draftsmith.core import storage

    torch.multiprocessing.set_sharing_strategy("file_system")
    start = time.perf_counter()
    rows = [r for n in manifest.names("conversations-") for r in storage.read_jsonl(manifest.path(n))]
    with mp.get_context("fork").Pool(workers, _naive_init, (tok_path,)) as pool:  # made after the corpus is loaded
        out = list(pool.imap(_naive_job, [r["messages"] for r in rows], chunksize=16))
    assert len(out) == len(rows)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # workers are the parallelism; the raw baseline turns it on
    os.environ["RAYON_NUM_THREADS"] = str(args.workers)  # read once, when the raw call starts the Rust pool

    from transformers import AutoTokenizer

    from draftsmith.core.config import TargetConfig, TokenizeConfig
    from draftsmith.core.target_setup import resolve_target
    from draftsmith.tasks.tokenization import tokenize

    target = TargetConfig(
        name="smollm2",
        source="embedded:smollm2-135m-instruct",
        num_layers=30,
        hidden_size=576,
        vocab_size=49152,
    )
    tok_path = str(resolve_target(target.source))
    tok = AutoTokenizer.from_pretrained(tok_path)
    rows = conversations(args.rows)
    with tempfile.TemporaryDirectory() as tmp:
        manifest = write_corpus(rows, f"{tmp}/regenerate")
        cfg = TokenizeConfig(max_length=4096, num_workers=args.workers, cache_uri="")
        stage_runs = []
        for k in range(3):  # best of 3, as the raw baseline
            start = time.perf_counter()
            m = tokenize(cfg, target, manifest, out_uri=f"{tmp}/tokenize-{k}")
            stage_runs.append(time.perf_counter() - start)
            assert m.counts["samples"] == len(rows), m.counts
            print(f"tokenize stage: {stage_runs[-1]:.1f} s", flush=True)
        naive_s = naive(manifest, tok_path, args.workers)
        print(f"naive stage: {naive_s:.1f} s", flush=True)

    texts = tok.apply_chat_template([r["messages"] for r in rows], tokenize=False)
    raw_runs: dict[str, Any] = {}
    for parallel in ("false", "true"):
        os.environ["TOKENIZERS_PARALLELISM"] = parallel
        raw_runs[parallel] = []
        for _ in range(3):
            start = time.perf_counter()
            tok(texts, add_special_tokens=False)
            raw_runs[parallel].append(time.perf_counter() - start)
    raw_s, one_s, stage_s = min(raw_runs["true"]), min(raw_runs["false"]), min(stage_runs)

    n = len(rows)
    turns = sum(len(r["messages"]) for r in rows) / n
    per_row = m.counts["tokens"] / n
    print(f"{n} conversations, {turns:.2f} messages, {per_row:.0f} tokens each; {args.workers} workers")
    print(f"raw tokenizer(texts), 1 thread:          {n / one_s:8.0f} rows/s  (best of 3)")
    print(f"raw tokenizer(texts), {args.workers} Rust threads:    {n / raw_s:8.0f} rows/s  (best of 3; the limit)")
    runs = ", ".join(f"{n / t:.0f}" for t in stage_runs)
    print(f"tokenize stage, {args.workers} workers:        {n / stage_s:8.0f} rows/s  (best of {runs}; with start-up)")
    print(f"stage / raw limit: x{raw_s / stage_s:.2f} (goal >= 0.7)")
    naive_rate = f"{n / naive_s:8.0f} rows/s  (stage x{naive_s / stage_s:.2f} faster)"
    print(f"naive stage, {args.workers} workers:           {naive_rate}")


if __name__ == "__main__":
    main()
