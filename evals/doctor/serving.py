"""Train–serve mismatch: first-draft acceptance measured by the evaluation harness against the serving
engine's own counters, from `speedup/speedup.json` (`draftsmith speedup`) and, with `--engine-url`, from a
running vLLM server sent the evaluation's prompts (or `--prompts FILE`) greedily.

First-draft acceptance is compared, not acc_len: it does not depend on how many drafts a round makes, so a
server at another depth than the evaluation still answers. Thresholds are in `docs/doctor.md`.
"""

import json
import math
import urllib.error
import urllib.request
from pathlib import Path

from draftsmith.evals.doctor import findings as F
from draftsmith.evals.doctor.facts import DoctorInputError, RunFacts
from draftsmith.evals.doctor.findings import Finding
from draftsmith.evals.sweep_bench import SpecDecode, parse_spec_counters, server_root

MIN_GAP = 0.05  # first-draft acceptance, absolute: below this a gap is not worth a look whatever the counts
SIGMAS = 3.0  # a gap must also exceed this many standard errors of the two binomial rates


def _harness(rows: list[dict]) -> tuple[float, int]:
    """First-draft acceptance over evaluation rows and the rounds behind it."""
    tries = sum((r.get("position_tries") or [0])[0] for r in rows)
    accepts = sum((r.get("position_accepts") or [0])[0] for r in rows)
    return accepts / max(1, tries), tries


def _compare(check: str, label: str, harness: tuple[float, int], served: SpecDecode, source: str) -> Finding:
    p_h, n_h = harness
    p_s = served.accepted_per_pos[0] / served.num_drafts if served.accepted_per_pos and served.num_drafts else 0.0
    n_s = served.num_drafts
    pooled = (p_h * n_h + p_s * n_s) / max(1, n_h + n_s)
    se = math.sqrt(pooled * (1 - pooled) * (1 / max(1, n_h) + 1 / max(1, n_s)))
    gap = p_h - p_s
    evidence = (
        f"evaluate/prompts.jsonl position_accepts[0]/position_tries[0]: {p_h:.3f} over {n_h} rounds",
        f"{source}: accepted_per_pos[0]/num_drafts {p_s:.3f} over {n_s} drafts; acceptance length "
        f"{served.acceptance_length:.3f} at {served.num_draft_tokens / max(1, n_s):.2g} drafts per step",
    )
    if abs(gap) > max(MIN_GAP, SIGMAS * se):
        return F.warn(check, f"{label} accepts {'fewer' if gap > 0 else 'more'} first drafts than the harness "
                      f"({p_s:.2f} against {p_h:.2f}, beyond {SIGMAS:g} standard errors)", *evidence,
                      fix="draftsmith export RUN --engine vllm (tap ids, vocabulary, norms as the engine reads them); "
                          "serve with the chat template the data used")  # fmt: skip
    return F.ok(check, f"{label} accepts first drafts as the harness does (gap {gap:+.3f}, noise {se:.3f})", *evidence)


def train_serve(f: RunFacts, engine_url: str | None = None, prompts: str | None = None) -> list[Finding]:
    check = "train-serve"
    if not f.rows:
        return [F.missing(check, "evaluate/prompts.jsonl is absent", "draftsmith run RECIPE (the evaluate stage)")]
    harness = _harness(f.rows)
    out = []
    counters = (f.speedup or {}).get("server_counters") or {}
    depths = {s["name"]: s for s in (f.speedup or {}).get("servers", []) if s.get("method") == "drafter"}
    for name in depths:
        if counters.get(name):
            fields = {k: counters[name][k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
            served = SpecDecode(**fields, accepted_per_pos=list(counters[name].get("accepted_per_pos") or []))
            source = f"speedup/speedup.json server_counters[{name}]"
            out.append(_compare(check, f"vLLM ({name}, draftsmith speedup)", harness, served, source))
    if engine_url:
        served, sent = measure_engine(engine_url, f.rows, prompts)
        label = f"the engine at {engine_url}"
        source = f"{server_root(engine_url)}/metrics over {sent} requests"
        if prompts:  # other prompts than the evaluation's: the harness figure is only a yardstick
            source += f" from {prompts}"
        out.append(_compare(check, label, harness, served, source))
    if not out:
        out.append(F.info(check, "no serving measurement to compare with the harness",
                          f"evaluate/prompts.jsonl first-draft acceptance {harness[0]:.3f} over {harness[1]} rounds",
                          fix="draftsmith speedup RUN, or draftsmith doctor RUN --engine-url URL"))  # fmt: skip
    return out


def _get(url: str, timeout_s: float) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.read()
    except (urllib.error.URLError, OSError) as err:
        raise DoctorInputError(f"--engine-url: GET {url}: {err}") from None


def _post(url: str, body: dict, timeout_s: float) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError) as err:
        raise DoctorInputError(f"--engine-url: POST {url}: {err}") from None


def _counters(root: str, timeout_s: float) -> SpecDecode:
    try:
        found = parse_spec_counters(_get(root + "/metrics", timeout_s).decode())
    except ValueError as err:
        raise DoctorInputError(f"--engine-url: {root}/metrics: {err}") from None
    if found is None:
        raise DoctorInputError(f"--engine-url: {root}/metrics has no spec-decode counters (speculation is off)")
    return found


def _requests(rows: list[dict], prompts: str | None) -> list[tuple[str, dict]]:
    """(endpoint, body) per request: the evaluation's rendered prompts as token ids (`/v1/completions`, no
    template applied again), or the lines of `--prompts` (JSONL: `prompt_ids`, or `prompt` text sent as a user
    message to `/v1/chat/completions`, where the server applies its chat template; optional `max_tokens`)."""
    if prompts is None:
        if any("prompt_ids" not in r for r in rows):
            raise DoctorInputError("--engine-url: evaluate/prompts.jsonl has no prompt_ids; pass --prompts FILE")
        return [
            ("/v1/completions", {"prompt": r["prompt_ids"], "max_tokens": max(1, len(r["output_ids"]))}) for r in rows
        ]
    bodies: list[tuple[str, dict]] = []
    try:
        lines = Path(prompts).read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise DoctorInputError(f"--prompts {prompts}: {err.strerror or err}") from None
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            size = {"max_tokens": int(row.get("max_tokens", 64))}
            if "prompt_ids" in row:
                bodies.append(("/v1/completions", {"prompt": [int(t) for t in row["prompt_ids"]]} | size))
            else:
                bodies.append(
                    ("/v1/chat/completions", {"messages": [{"role": "user", "content": str(row["prompt"])}]} | size)
                )
        except (ValueError, KeyError, TypeError, AttributeError):
            raise DoctorInputError(
                f"--prompts {prompts}:{i}: expected a JSON object with prompt (text) or prompt_ids (integers)"
            ) from None
    if not bodies:
        raise DoctorInputError(f"--prompts {prompts}: no prompts")
    return bodies


def measure_engine(url: str, rows: list[dict], prompts: str | None, timeout_s: float = 300.0) -> tuple[SpecDecode, int]:
    """The engine's spec-decode counters over greedy completions of the prompts: the difference of
    `/metrics` read before and after (the server's lifetime counters include other traffic otherwise)."""
    root = server_root(url)
    bodies = _requests(rows, prompts)
    models = json.loads(_get(root + "/v1/models", timeout_s)).get("data") or []
    if not models:
        raise DoctorInputError(f"--engine-url: {root}/v1/models lists no model")
    before = _counters(root, timeout_s)
    for endpoint, body in bodies:
        _post(root + endpoint, body | {"model": models[0]["id"], "temperature": 0.0}, timeout_s)
    after = _counters(root, timeout_s)
    delta = after.since(before)
    if delta.num_drafts <= 0:
        raise DoctorInputError(f"--engine-url: {root}/metrics counted no drafts over {len(bodies)} requests")
    return delta, len(bodies)
