"""PNG plots of an evaluation: acceptance by benchmark, throughput against concurrency, per-position acceptance
and the DSpark reliability diagram.

Figures are built with the object-oriented `matplotlib.figure.Figure` API on the Agg canvas: no pyplot global
state and no display backend, so plotting works in worker threads and on headless CI. Every figure has a fixed
size in inches and a fixed dpi and is saved without `bbox_inches="tight"` (which would crop to the content), so
each PNG's pixel size is `PIXELS[name]` whatever the data.

Inputs are the per-benchmark result dicts of results.json (`{"bench", "drafter", "temperature", "top_p",
"acc_len", "rounds", "accepted", "accept_hist", "position_accept", "tokens_per_s"}`) and sweep dicts
`{"drafter", "speculative", "levels": [{"concurrency", "output_tokens_per_s", ...}]}`.
"""

import io
import math
from collections.abc import Iterable, Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

DPI = 100
# Figure sizes in inches; the PNGs are these times DPI pixels.
_INCHES = {
    "acc_len_by_bench": (10.0, 5.0),
    "throughput_vs_concurrency": (8.0, 5.0),
    "speedup": (8.0, 5.0),
    "position_acceptance": (8.0, 5.0),
    "reliability_diagram": (6.0, 7.0),
}
PIXELS: dict[str, tuple[int, int]] = {k: (round(w * DPI), round(h * DPI)) for k, (w, h) in _INCHES.items()}

_RESULT_KEYS = ("bench", "drafter", "acc_len")


def require(record: dict, keys: Iterable[str], what: str) -> None:
    """Raise `KeyError` naming the first missing key and the record it is missing from."""
    if not isinstance(record, dict):
        raise TypeError(f"{what} must be a dict, got {type(record).__name__}")
    for key in keys:
        if key not in record:
            raise KeyError(f"{what} has no {key!r} key (keys: {sorted(record)})")


def series_label(result: dict, several_settings: bool) -> str:
    """A drafter's legend label; the sampling settings are added only when the results mix several."""
    if not several_settings:
        return str(result["drafter"])
    return f"{result['drafter']} T={result.get('temperature', 0.0):g} p={result.get('top_p', 1.0):g}"


def _settings(results: list[dict]) -> set[tuple]:
    return {(r.get("temperature", 0.0), r.get("top_p", 1.0)) for r in results}


def _group(results: list[dict], keys: Sequence[str]) -> tuple[list[str], dict[str, list[dict]]]:
    """Validate `results` and group them by series label, in order of first appearance."""
    if not results:
        raise ValueError("no results to plot")
    for i, r in enumerate(results):
        require(r, keys, f"results[{i}]")
    several = len(_settings(results)) > 1
    labels: list[str] = []
    groups: dict[str, list[dict]] = {}
    for r in results:
        label = series_label(r, several)
        if label not in groups:
            labels.append(label)
            groups[label] = []
        groups[label].append(r)
    return labels, groups


def _figure(name: str, **kwargs) -> Figure:
    fig = Figure(figsize=_INCHES[name], dpi=DPI, layout="constrained", **kwargs)
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, path: str | Path) -> bytes:
    """Write the PNG to `path` (parents created) and return its bytes."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, metadata={"Software": None})
    data = buf.getvalue()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return data


def acc_len_by_bench(results: list[dict], path: str | Path) -> bytes:
    """Grouped bars: one group per benchmark, one bar per drafter (per sampling setting), value on each bar."""
    labels, groups = _group(results, _RESULT_KEYS)
    benches: list[str] = []
    for r in results:
        if r["bench"] not in benches:
            benches.append(r["bench"])
    table: dict[tuple[str, str], float] = {}
    for label in labels:
        for r in groups[label]:
            if (label, r["bench"]) in table:
                raise ValueError(f"two results for drafter {label!r} on bench {r['bench']!r}")
            table[label, r["bench"]] = float(r["acc_len"])

    fig = _figure("acc_len_by_bench")
    ax = fig.add_subplot()
    width = 0.8 / len(labels)
    for j, label in enumerate(labels):
        xs = [i + (j - (len(labels) - 1) / 2) * width for i, b in enumerate(benches) if (label, b) in table]
        ys = [table[label, b] for b in benches if (label, b) in table]
        bars = ax.bar(xs, ys, width=width * 0.95, label=label)
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=1)
    ax.set_xticks(range(len(benches)), benches, rotation=20 if len(benches) > 6 else 0)
    ax.set_ylabel("acceptance length (tokens per round)")
    ax.set_ylim(0, max(table.values()) * 1.15)
    ax.set_title("Acceptance length by benchmark")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def _check_sweep(i: int, sweep: dict) -> list[tuple[int, float]]:
    require(sweep, ("drafter", "speculative", "levels"), f"sweeps[{i}]")
    if not sweep["levels"]:
        raise ValueError(f"sweeps[{i}] has no levels")
    points = []
    for j, level in enumerate(sweep["levels"]):
        require(level, ("concurrency", "output_tokens_per_s"), f"sweeps[{i}]['levels'][{j}]")
        if level["concurrency"] < 1:
            raise ValueError(f"sweeps[{i}]['levels'][{j}]['concurrency'] must be >= 1, got {level['concurrency']}")
        points.append((int(level["concurrency"]), float(level["output_tokens_per_s"])))
    return sorted(points)


def throughput_vs_concurrency(sweeps: list[dict], path: str | Path) -> bytes:
    """Output tokens/s against concurrency (log2 axis); solid = speculation on, dashed = off, a colour per drafter."""
    if not sweeps:
        raise ValueError("no sweeps to plot")
    series = [(s["drafter"], bool(s["speculative"]), _check_sweep(i, s)) for i, s in enumerate(sweeps)]
    fig = _figure("throughput_vs_concurrency")
    ax = fig.add_subplot()
    colours: dict[str, str] = {}
    for drafter, on, points in series:
        colour = colours.setdefault(drafter, f"C{len(colours) % 10}")
        xs, ys = zip(*points, strict=True)
        label = f"{drafter}, speculation {'on' if on else 'off'}"
        ax.plot(xs, ys, marker="o" if on else "s", linestyle="-" if on else "--", color=colour, label=label)
    levels = sorted({c for _, _, pts in series for c, _ in pts})
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.minorticks_off()
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("output tokens/s")
    ax.set_ylim(bottom=0)
    ax.set_title("Serving throughput against concurrency")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def speedup_bars(result: dict, path: str | Path) -> bytes:
    """Each server's speed-up over plain serving at each concurrency level (bars: mean tokens/s over the plain
    server's; ticks: each round's), the trained drafter's depths and the free methods side by side, labelled with
    vLLM's acceptance length. `result` is `draftsmith.evals.speedup`'s dict."""
    levels = result.get("levels") or []
    if not levels:
        raise ValueError("speed-up result has no levels")
    groups: dict[int, list[dict]] = {}
    for i, lv in enumerate(levels):
        require(lv, ("concurrency", "tokens_per_s_off", "tokens_per_s_on", "speedup"), f"levels[{i}]")
        groups.setdefault(int(lv["concurrency"]), []).append(lv)
    names = list(dict.fromkeys(_server_name(lv) for lv in levels))
    fig = _figure("speedup")
    ax = fig.add_subplot()
    width = 0.8 / len(names)
    for i, rows in enumerate(groups.values()):
        for lv in rows:
            j = names.index(_server_name(lv))
            x = i + (j - (len(names) - 1) / 2) * width
            plain = sum(lv["tokens_per_s_off"]) / len(lv["tokens_per_s_off"])
            ticks = [t / plain for t in lv["tokens_per_s_on"]] if plain > 0 else [0.0]
            ax.bar(x, lv["speedup"], width, color=f"C{j}", label=None if i else _server_name(lv))
            ax.plot([x] * len(ticks), ticks, "k_", markersize=max(4, 30 * width))
            spec = lv.get("spec_decode")
            acc = f"\nacc {spec['acceptance_length']:.2f}" if spec else ""
            ax.annotate(f"x{lv['speedup']:.2f}{acc}", (x, max(ticks + [lv["speedup"]])), ha="center", va="bottom",
                        fontsize=6)  # fmt: skip
    ax.axhline(1.0, color="k", linewidth=0.8, linestyle="--", label="plain serving")
    ax.set_xticks(range(len(groups)), [str(c) for c in groups])
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("tokens/s over plain serving")
    ax.set_ylim(0, 1.25 * max(lv["speedup"] for lv in levels) + 0.3)
    ax.set_title("Speed-up in vLLM over plain serving: the drafter and free speculation, interleaved runs")
    ax.legend(fontsize=7, loc="upper right")
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, path)


def _server_name(lv: dict) -> str:
    if lv.get("server"):
        return str(lv["server"])
    depth = lv.get("draft_tokens")
    return "drafter" if depth is None else f"drafter-{depth}"


def pooled_position_accept(group: list[dict]) -> list[float]:
    """One drafter's per-position conditional acceptance over several benchmarks.

    Each benchmark's `position_accept[k]` is weighted by how many of its rounds reached position k (rounds with
    at least k drafts accepted, from `accept_hist`), so a benchmark counts as much as it has trials there; with
    one benchmark this returns its list unchanged.
    """
    depth = max(len(r["position_accept"]) for r in group)
    pooled = []
    for k in range(depth):
        num = den = 0.0
        for r in group:
            if k >= len(r["position_accept"]):
                continue
            reached = sum(r["accept_hist"][k:])
            num += reached * float(r["position_accept"][k])
            den += reached
        pooled.append(num / den if den else math.nan)
    return pooled


def position_acceptance(results: list[dict], path: str | Path) -> bytes:
    """P(draft k accepted | drafts 1..k-1 accepted) against draft position, one line per drafter."""
    labels, groups = _group(results, ("bench", "drafter", "position_accept", "accept_hist"))
    fig = _figure("position_acceptance")
    ax = fig.add_subplot()
    depth = 1
    for label in labels:
        rates = pooled_position_accept(groups[label])
        depth = max(depth, len(rates))
        ax.plot(range(1, len(rates) + 1), rates, marker="o", label=label)
    ax.set_xticks(range(1, depth + 1))
    ax.set_xlabel("draft position k")
    ax.set_ylabel("P(accept k | 1..k-1 accepted)")
    ax.set_ylim(0, 1.02)
    ax.set_title("Per-position conditional acceptance (all benchmarks pooled)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def _check_bins(bins: Sequence, name: str) -> list[tuple[float, float, float, float, int]]:
    if not bins:
        raise ValueError(f"{name} is empty")
    out = []
    for i, b in enumerate(bins):
        if len(b) != 5:
            raise ValueError(f"{name}[{i}] must be (lo, hi, mean_conf, accuracy, count), got {len(b)} values")
        lo, hi, conf, acc = (float(v) for v in b[:4])
        count = int(b[4])
        if not 0.0 <= lo < hi <= 1.0:
            raise ValueError(f"{name}[{i}] needs 0 <= lo < hi <= 1, got lo={lo} hi={hi}")
        if count < 0:
            raise ValueError(f"{name}[{i}] count must be >= 0, got {count}")
        out.append((lo, hi, conf, acc, count))
    return out


def _ece_label(what: str, ece: float | None) -> str:
    return what if ece is None else f"{what} (ECE {ece:.4f})"


def reliability_diagram(
    bins: Sequence[tuple[float, float, float, float, int]],
    path: str | Path,
    *,
    ece_before: float | None = None,
    ece_after: float | None = None,
    bins_before: Sequence[tuple[float, float, float, float, int]] | None = None,
) -> bytes:
    """Accuracy against confidence per bin, calibrated (`bins`) and optionally uncalibrated (`bins_before`).

    Each bin is `(lo, hi, mean_conf, accuracy, count)`; empty bins are not drawn. A perfectly calibrated head
    lies on the diagonal. The lower panel shows how many predictions fall in each bin.
    """
    after = _check_bins(bins, "bins")
    before = _check_bins(bins_before, "bins_before") if bins_before is not None else None
    fig = _figure("reliability_diagram")
    ax, hist = fig.subplots(2, 1, sharex=True, height_ratios=[3, 1])
    ax.plot([0, 1], [0, 1], color="grey", linestyle=":", label="perfect calibration")
    filled = [b for b in after if b[4] > 0]
    ax.bar(
        [b[0] for b in filled],
        [b[3] for b in filled],
        width=[b[1] - b[0] for b in filled],
        align="edge",
        alpha=0.35,
        edgecolor="C0",
        color="C0",
    )
    ax.plot([b[2] for b in filled], [b[3] for b in filled], "o-", color="C0", label=_ece_label("calibrated", ece_after))
    hist.bar(
        [b[0] for b in after],
        [b[4] for b in after],
        width=[b[1] - b[0] for b in after],
        align="edge",
        alpha=0.5,
        color="C0",
        label="calibrated",
    )
    if before is not None:
        shown = [b for b in before if b[4] > 0]
        label = _ece_label("before calibration", ece_before)
        ax.plot([b[2] for b in shown], [b[3] for b in shown], "s--", color="C3", label=label)
        hist.step(
            [b[0] for b in before] + [before[-1][1]],
            [b[4] for b in before] + [before[-1][4]],
            where="post",
            color="C3",
            label="before",
        )
    elif ece_before is not None:
        ax.plot([], [], " ", label=f"before calibration: ECE {ece_before:.4f}")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_ylabel("observed accuracy")
    ax.set_title("DSpark confidence reliability")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    hist.set_xlabel("predicted confidence")
    hist.set_ylabel("count")
    hist.legend(fontsize=7)
    return _save(fig, path)
