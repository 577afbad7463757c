"""What a speed-up measurement (`evals.speedup`) says: the table, which server to run at each load, and the
drafter's serving schedule (draft tokens per batch size) that `draftsmith export` prints.

The recommendation is honest by construction: at each level it names the fastest server measured, free methods
included, and says so when a free method beats the trained drafter.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# A drafter depth must beat plain serving by this much to enter the schedule; below it, speculation is
# within the measurement's noise of not paying and costs verification work the other requests share.
MIN_GAIN = 1.02


def first_accepted(spec: dict | None) -> float | None:
    """Share of drafts whose first token was accepted (vLLM's per-position counter over its drafts)."""
    if not spec or not spec.get("num_drafts") or not spec.get("accepted_per_pos"):
        return None
    return spec["accepted_per_pos"][0] / spec["num_drafts"]


def _load_cell(load: dict | None) -> str:
    if not load:
        return "–"
    parts = [f"{load['load_avg_1m']:.1f}"]
    parts += [f"{load[key]:.2f}" for key in ("other_cores", "steal_cores") if load.get(key) is not None]
    return " / ".join(parts) + (" **busy**" if load.get("busy") else "")


def _busy_warning(busy: list[dict], rows: int) -> str:
    """One line naming what took the cores in the busiest row: other processes, the host (steal), or both."""

    def taken(row: dict) -> float:
        return (row["load"].get("other_cores") or 0.0) + (row["load"].get("steal_cores") or 0.0)

    load = max(busy, key=taken)["load"]
    takers = []
    if load.get("other_cores"):
        takers.append(f"other processes used up to {load['other_cores']:.2f}")
    if load.get("steal_cores"):
        takers.append(f"the host took up to {load['steal_cores']:.2f} (steal)")
    return (
        f"warning: {' and '.join(takers) or 'something used'} of {load['cores']} cores during {len(busy)} of {rows} "
        "rows; speculation suffers most from shared cores, so these figures are not an idle machine's"
    )


def format_table(result: dict[str, Any]) -> str:
    """A markdown table: per level and server, tokens/s plain and with the server (every round), speed-up, vLLM's
    acceptance length and first-draft acceptance, outputs differing and the machine's load."""
    lines = [
        "| concurrency | server | tokens/s plain | tokens/s | speed-up | acceptance length (vLLM) "
        "| first draft accepted | outputs differing | load avg / other cores / host steal |",
        "|---:|---|---|---|---:|---:|---:|---:|---|",
    ]
    for lv in result["levels"]:
        spec = lv["spec_decode"]
        acc = f"{spec['acceptance_length']:.3f}" if spec else "no drafts"
        first = first_accepted(spec)
        lines.append(
            f"| {lv['concurrency']} | {lv.get('server') or _legacy_name(lv)} "
            f"| {', '.join(f'{t:.1f}' for t in lv['tokens_per_s_off'])} "
            f"| {', '.join(f'{t:.1f}' for t in lv['tokens_per_s_on'])} | ×{lv['speedup']:.2f} | {acc} "
            f"| {'–' if first is None else f'{first:.0%}'} "
            f"| {lv['outputs_differing']} of {lv['outputs_compared']} | {_load_cell(lv.get('load'))} |"
        )
    return "\n".join(lines)


def _legacy_name(level: dict) -> str:
    depth = level.get("draft_tokens")
    return "drafter" if depth is None else f"drafter-{depth}"


def _by_level(result: dict[str, Any]) -> dict[int, list[dict]]:
    levels: dict[int, list[dict]] = {}
    for lv in result["levels"]:
        levels.setdefault(lv["concurrency"], []).append(lv)
    return levels


def schedule(result: dict[str, Any]) -> dict[int, int]:
    """Draft tokens per level for the trained drafter: the measured depth with the highest speed-up, or 0 where
    no depth beats plain serving by `MIN_GAIN`. Empty when the drafter's export fixes its own depth."""
    out = {}
    for c, rows in _by_level(result).items():
        depths = [r for r in rows if r.get("method", "drafter") == "drafter" and r.get("draft_tokens")]
        if not depths:
            return {}
        best = max(depths, key=lambda r: r["speedup"])
        out[c] = best["draft_tokens"] if best["speedup"] >= MIN_GAIN else 0
    return out


def batch_size_ranges(per_level: dict[int, int]) -> list[list[int]]:
    """vLLM's `num_speculative_tokens_per_batch_size`: inclusive batch-size ranges from each measured level up to
    the next, the last open-ended (vLLM carries its value on); neighbouring equal values are merged."""
    levels = sorted(per_level)
    ranges: list[list[int]] = []
    for i, c in enumerate(levels):
        start = 1 if i == 0 else c
        end = levels[i + 1] - 1 if i + 1 < len(levels) else c
        if ranges and ranges[-1][2] == per_level[c]:
            ranges[-1][1] = end
        else:
            ranges.append([start, end, per_level[c]])
    return ranges


def recommendation(result: dict[str, Any]) -> list[str]:
    """One line per level: the fastest server, the drafter against the best free method, and a warning when
    the measurement ran on a busy machine."""
    lines = []
    for c, rows in sorted(_by_level(result).items()):
        best = max(rows, key=lambda r: r["speedup"])
        drafter = max((r for r in rows if r.get("method", "drafter") == "drafter"), key=lambda r: r["speedup"])
        free = [r for r in rows if r.get("method") in ("ngram", "suffix")]
        line = f"concurrency {c}: "
        if best["speedup"] < 1.0:
            line += f"serve plain (every speculating server is slower; best {_name(best)} ×{best['speedup']:.2f})"
        else:
            line += f"fastest is {_name(best)} ×{best['speedup']:.2f}"
        if free:
            top = max(free, key=lambda r: r["speedup"])
            ratio = drafter["speedup"] / top["speedup"] if top["speedup"] > 0 else float("inf")
            verdict = "beats" if ratio >= 1.0 else "LOSES TO"
            line += f"; the drafter ({_name(drafter)}) {verdict} {_name(top)}: ×{ratio:.2f} its tokens/s"
        lines.append(line)
    lines += [f"{method}: not measured: {why}" for method, why in (result.get("skipped") or {}).items()]
    busy = [r for r in result["levels"] if (r.get("load") or {}).get("busy")]
    if busy:
        lines.append(_busy_warning(busy, len(result["levels"])))
    if (result.get("prompts") or {}).get("repeated"):
        lines.append(
            f"note: {result['prompts']['distinct']} distinct prompts for {result['prompts']['requests']} requests; "
            "repeated prompts flatter suffix decoding, which caches earlier answers"
        )
    return lines


def _name(row: dict) -> str:
    return row.get("server") or _legacy_name(row)


def headline(result: dict[str, Any], levels: Sequence[int] | None = None) -> dict[int, dict[str, float]]:
    """Per level: the best drafter depth's speed-up and each free method's, for summaries and the README."""
    out: dict[int, dict[str, float]] = {}
    for c, rows in _by_level(result).items():
        if levels is not None and c not in levels:
            continue
        entry: dict[str, float] = {}
        for r in rows:
            key = r.get("method", "drafter")
            entry[key] = max(entry.get(key, 0.0), r["speedup"])
        out[c] = entry
    return out
