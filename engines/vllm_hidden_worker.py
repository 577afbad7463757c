"""vLLM target hidden-state capture: the shared core, and a JSON-lines worker that runs inside a vLLM venv.

Like `vllm_worker.py`, this imports only the standard library and vLLM (lazily), never draftsmith, so it
runs as a script under `.venv-vllm/bin/python`; `draftsmith.engines.vllm_hidden` imports the same functions when vLLM
lives in the main environment.

vLLM's `extract_hidden_states` speculative method caches the residual stream at the aux layer ids in a
cache-only KV layer; `CPUHiddenStatesConnector` (from `vllm_hidden_connector.py`, next to this file) writes
one safetensors file per finished request: `hidden_states [S, N, H]` and `token_ids [S]` for the prompt.

Protocol (one JSON object per line). Started as `python vllm_hidden_worker.py CONFIG_JSON`, CONFIG_JSON =
`{"model", "max_model_len", "seed", "engine_kwargs", "aux_layer_ids", "out_dir"}`; writes
`{"ready": true, "vllm_version"}` once the engine is up. Then for each stdin line `{"id", "token_ids":
[[int, ...], ...]}` it writes `{"id", "paths": [str, ...]}` (one finished file per sequence, in order) or
`{"id", "error": "..."}`. It exits when stdin closes.
"""

from __future__ import annotations

import fcntl
import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CONNECTOR_MODULE = "vllm_hidden_connector"


def connector_on_path() -> None:
    """Make `vllm_hidden_connector` importable here and in vLLM's engine-core child processes."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(HERE) not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), *parts])


def build_llm(config: dict[str, Any]) -> Any:
    """Start a `vllm.LLM` that saves the aux layers' hidden states of every prompt under `config["out_dir"]`."""
    from vllm import LLM

    connector_on_path()
    kwargs = {"max_model_len": config["max_model_len"], "seed": config["seed"]}
    kwargs.update(config.get("engine_kwargs") or {})
    kwargs["speculative_config"] = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,  # the method accepts exactly 1
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(config["aux_layer_ids"])}},
    }
    kwargs["kv_transfer_config"] = {
        "kv_connector": "CPUHiddenStatesConnector",
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": config["out_dir"]},
    }
    return LLM(model=config["model"], **kwargs)


def _wait_written(path: str) -> None:
    # The connector holds LOCK_EX on `<path>.lock` until the file is fully written; a shared lock sleeps until then.
    with open(path + ".lock") as lf:
        fcntl.flock(lf, fcntl.LOCK_SH)
    os.remove(path + ".lock")


def capture(llm: Any, token_ids: list[list[int]]) -> list[str]:
    """Run each sequence as a prompt (one generated token, discarded) and return its hidden-states file."""
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": list(ids)} for ids in token_ids]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    paths = []
    for i, out in enumerate(outputs):
        params = out.kv_transfer_params or {}
        path = params.get("hidden_states_path")
        if path is None:
            raise RuntimeError(f"sequence {i}: vLLM returned no hidden_states_path (kv_transfer_params={params})")
        _wait_written(path)
        paths.append(path)
    return paths


def main(argv: list[str]) -> int:
    # The sibling script (shared env defaults and stdout handling), on the path as this one's folder: run as a
    # script in vLLM's venv, neither is importable as a draftsmith module there.
    vllm_worker = importlib.import_module("vllm_worker")

    if len(argv) != 2:
        sys.stderr.write("usage: vllm_hidden_worker.py CONFIG_JSON\n")
        return 2
    proto = vllm_worker._protocol_stream()
    for key, value in vllm_worker.VLLM_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    llm = build_llm(json.loads(argv[1]))
    import vllm

    proto.write(json.dumps({"ready": True, "vllm_version": vllm.__version__}) + "\n")
    proto.flush()
    vllm_worker.serve(proto, lambda msg: {"paths": capture(llm, msg["token_ids"])})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
