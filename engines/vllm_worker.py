"""vLLM offline batch generation: the shared core, and a JSON-lines worker that runs inside a vLLM venv.

This module imports only the standard library and vLLM (lazily), never draftsmith: it runs as a script
under the interpreter of a separate vLLM environment (`.venv-vllm` on CPU machines), where draftsmith is
not installed. `draftsmith.engines.vllm_offline` imports the same functions when vLLM lives in the main environment.

Protocol (one JSON object per line). The worker is started as `python vllm_worker.py CONFIG_JSON`, where
CONFIG_JSON is `{"model", "max_model_len", "seed", "engine_kwargs"}`. Once the engine is up it writes
`{"ready": true, "vllm_version", "chat_template"}`. Then, for each line on stdin,
`{"id", "requests": [{"messages", "tools"}], "params": {"max_tokens", "temperature", "top_p", "n", "seed",
"extra_body"}}`, it writes `{"id", "outputs": [[{"text", "num_tokens", "finish_reason"}, ...], ...]}` or
`{"id", "error": "..."}`. It exits when stdin closes.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

# vLLM's CPU backend reserves a core for its front end unless VLLM_CPU_NUM_OF_RESERVED_CPU says otherwise. On a
# machine with at most SMALL_MACHINE_CPUS usable CPUs the model gets every core instead: on 2 cores the reserved
# core left the model a single thread, and plain serving at concurrency 1 ran 13 tokens/s against 17 with both
# cores (docs/benchmarks.md).
SMALL_MACHINE_CPUS = 2


def cpu_env_defaults(num_cpus: int) -> dict[str, str]:
    """The vLLM environment defaults for a machine with `num_cpus` usable CPUs; a GPU image ignores the CPU
    settings, and any of them may be overridden in the environment."""
    env = {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    if num_cpus <= SMALL_MACHINE_CPUS:
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    return env


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the platform has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


VLLM_ENV_DEFAULTS = cpu_env_defaults(usable_cpus())


def build_llm(config: dict[str, Any]) -> Any:
    """Start a `vllm.LLM` for `config` = `{"model", "max_model_len", "seed", "engine_kwargs"}`."""
    from vllm import LLM

    kwargs = {"max_model_len": config["max_model_len"], "seed": config["seed"]}
    kwargs.update(config.get("engine_kwargs") or {})
    return LLM(model=config["model"], **kwargs)


def engine_info(llm: Any) -> dict[str, Any]:
    """The vLLM version and the chat template text the tokenizer renders with (None if it has none)."""
    import vllm

    tokenizer = llm.get_tokenizer()
    return {"vllm_version": vllm.__version__, "chat_template": getattr(tokenizer, "chat_template", None)}


def _sampling(params: dict[str, Any]) -> Any:
    from vllm import SamplingParams

    return SamplingParams(
        n=params["n"],
        temperature=params["temperature"],
        top_p=params["top_p"],
        max_tokens=params["max_tokens"],
        seed=params.get("seed"),
    )


def _completion(out: Any) -> dict[str, Any]:
    # vLLM says "stop" for an end-of-turn token or a stop string and "length" for the limit; anything
    # else (e.g. "abort") is a failure the caller must not store as an answer.
    if out.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM finished a sequence with finish_reason={out.finish_reason!r}")
    return {"text": out.text, "num_tokens": len(out.token_ids), "finish_reason": out.finish_reason}


def run_batch(llm: Any, requests: list[dict[str, Any]], params: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """Answer every request with `params["n"]` completions, in request order.

    `LLM.chat` takes one tool list per call, so requests are grouped by their tools and each group is
    one batched call; `extra_body` becomes the chat template's keyword arguments (e.g. `enable_thinking`).
    """
    sampling = _sampling(params)
    template_kwargs = params.get("extra_body") or None
    groups: dict[str, list[int]] = {}
    for i, req in enumerate(requests):
        groups.setdefault(json.dumps(req.get("tools"), sort_keys=True), []).append(i)
    results: list[list[dict[str, Any]]] = [[] for _ in requests]
    for key, idx in groups.items():
        outputs = llm.chat(
            [requests[i]["messages"] for i in idx],
            sampling,
            use_tqdm=False,
            tools=json.loads(key),
            chat_template_kwargs=template_kwargs,
        )
        for i, ro in zip(idx, outputs, strict=True):
            results[i] = [_completion(o) for o in ro.outputs]
    return results


def _protocol_stream() -> Any:
    """Keep the real stdout for the protocol and point fd 1 at stderr.

    vLLM, its engine-core child process and native libraries print to fd 1; after this only protocol
    lines reach the parent's pipe and everything else lands in the log.
    """
    proto_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return os.fdopen(proto_fd, "w", buffering=1, encoding="utf-8")


def serve(proto: Any, handle: Callable[[dict], dict]) -> None:
    """Answer each request line on stdin with `{"id", **handle(msg)}`, or `{"id", "error"}` if it raised."""
    for line in sys.stdin:
        if not line.strip():
            continue
        msg = json.loads(line)
        try:
            reply = {"id": msg["id"], **handle(msg)}
        except Exception as exc:  # report to the parent and keep serving: one bad batch is not fatal
            traceback.print_exc(file=sys.stderr)
            reply = {"id": msg.get("id"), "error": f"{type(exc).__name__}: {exc}"}
        proto.write(json.dumps(reply) + "\n")
        proto.flush()


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        sys.stderr.write("usage: vllm_worker.py CONFIG_JSON\n")
        return 2
    proto = _protocol_stream()
    for key, value in VLLM_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    config = json.loads(argv[1])
    llm = build_llm(config)
    proto.write(json.dumps({"ready": True, **engine_info(llm)}) + "\n")
    proto.flush()
    serve(proto, lambda msg: {"outputs": run_batch(llm, msg["requests"], msg["params"])})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
