"""Per-engine serving conventions: which layer ids a draft config stores, and how each engine is launched.

Facts, and where they come from:
- vLLM (0.32 source, `vllm/config/speculative.py`, `v1/worker/gpu/spec_decode/eagle/eagle3_utils.py`):
  EAGLE-3 aux id L = residual stream after L decoder layers (= our tap, as-is). DFlash/DSpark configs store
  z-lab `target_layer_ids` = taps - 1, and vLLM adds 1 back. `--speculative-config` JSON takes
  `method`, `model`, `num_speculative_tokens`; DFlash does not read `block_size`, so the token count is required.
- SGLang (docs.sglang.io "Speculative Decoding"): `python -m sglang.launch_server --model-path T
  --speculative-algorithm EAGLE3|DFLASH|DSPARK --speculative-draft-model-path D --speculative-num-steps N
  --speculative-eagle-topk 1 --speculative-num-draft-tokens N+1`. An SGLang-native EAGLE-3 loader counts
  aux ids from 0 (taps - 1; e.g. Kimi K3 taps [2,46,90] are [1,45,89] there).
- TokenSpeed (lightseekorg/tokenspeed docs/recipes/speculative_decoding.md, docs/configuration/server.md):
  `tokenspeed serve T --speculative-algorithm EAGLE3|DFLASH --speculative-draft-model-path D
  --speculative-num-steps N`; EAGLE-3 aux ids as vLLM's. Its `--speculative-config` JSON schema and any
  DSpark support are not documented there, so this module does not claim them.
"""

import json
import shlex

ENGINES = ("vllm", "sglang", "tokenspeed")
METHODS = ("eagle3", "dflash", "dspark")
_SGLANG_ALGORITHM = {"eagle3": "EAGLE3", "dflash": "DFLASH", "dspark": "DSPARK"}


def check_engine(engine: str, method: str) -> None:
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r}: expected one of {', '.join(ENGINES)}")
    if method not in METHODS:
        raise ValueError(f"drafter {method!r}: expected one of {', '.join(METHODS)}")


def aux_convention(method: str, engine: str) -> str:
    if method == "eagle3" and engine in ("vllm", "tokenspeed"):
        return "aux id = tap (residual after layer k, from 1)"
    return "id = tap - 1 (0-based layer output)"


def aux_layer_ids(method: str, engine: str, taps: list[int]) -> list[int]:
    """The layer ids `engine` expects in the draft config for our taps (residual after layer k, from 1)."""
    check_engine(engine, method)
    if method == "eagle3" and engine in ("vllm", "tokenspeed"):
        return [int(t) for t in taps]
    return [int(t) - 1 for t in taps]


def num_speculative_tokens(method: str, *, depth: int | None = None, block_size: int | None = None) -> int:
    """Draft tokens per round: EAGLE-3 its trained depth, DFlash block - 1 (slot 0 is the anchor), DSpark block."""
    if method == "eagle3":
        if not depth or depth < 1:
            raise ValueError("eagle3: the trained depth (drafter.ttt_depth) is needed for num_speculative_tokens")
        return depth
    if not block_size or block_size < 2:
        raise ValueError(f"{method}: block_size must be at least 2, got {block_size}")
    return block_size - 1 if method == "dflash" else block_size


def vllm_speculative_config(method: str, folder: str, num_tokens: int) -> dict:
    return {"method": method, "model": folder, "num_speculative_tokens": num_tokens}


def engine_args(method: str, engine: str, folder: str, num_tokens: int) -> list[str]:
    """The speculative-decoding arguments of `engine`'s launch command."""
    check_engine(engine, method)
    if engine == "vllm":
        return ["--speculative-config", json.dumps(vllm_speculative_config(method, folder, num_tokens))]
    args = ["--speculative-algorithm", _SGLANG_ALGORITHM[method], "--speculative-draft-model-path", folder]
    if method == "eagle3":
        args += ["--speculative-num-steps", str(num_tokens), "--speculative-eagle-topk", "1"]
        args += ["--speculative-num-draft-tokens", str(num_tokens + 1)]
    elif engine == "sglang" and method == "dspark":
        args += ["--speculative-dspark-block-size", str(num_tokens)]
    else:
        # A block drafter verifies the whole block: the anchor plus its drafts.
        args += ["--speculative-num-draft-tokens", str(num_tokens + 1)]
    return args


def launch_command(method: str, engine: str, target: str, folder: str, num_tokens: int) -> str:
    """A shell command that serves `target` with the exported drafter (127.0.0.1 only)."""
    spec = engine_args(method, engine, folder, num_tokens)
    if engine == "vllm":
        head = ["vllm", "serve", target, "--host", "127.0.0.1"]
    elif engine == "sglang":
        head = ["python", "-m", "sglang.launch_server", "--model-path", target, "--host", "127.0.0.1"]
    else:
        head = ["tokenspeed", "serve", target, "--host", "127.0.0.1"]
    return shlex.join(head + spec)


def engine_notes(method: str, engine: str) -> list[str]:
    """Caveats printed with the command: what this project has and has not verified."""
    notes = []
    if engine == "vllm" and method == "dspark":
        notes.append("vLLM serves DSpark on the V2 model runner only (GPU; V1 refuses method 'dspark').")
    if engine == "tokenspeed" and method == "dspark":
        notes.append(
            "TokenSpeed's DSpark flags are not documented in the sources checked; "
            "the command reuses its EAGLE3/DFLASH flags with algorithm DSPARK, unverified."
        )
    if engine == "tokenspeed" and method != "eagle3":
        notes.append("TokenSpeed's --speculative-config JSON schema is undocumented here; flags are printed instead.")
    if engine == "sglang" and method in ("dflash", "dspark"):
        notes.append("SGLang reads the block size from the draft config; verify the flags against your SGLang build.")
    return notes
