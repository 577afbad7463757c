"""Figures for `benchmarks.scaling`: expected accepted tokens per round, the log-linear fits, crossings, the plot.

Expected accepted tokens per round comes from the per-position acceptance of the evaluation (the conditional
rate of accepting draft k given the drafts before it were accepted): the probability that the first k drafts
are all accepted is the product of the first k rates, and the expectation is the sum of those products. It
depends only on the drafter and the target, not on the decoding engine's speed.
"""

import math
from itertools import combinations, pairwise
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

DPI = 100
INCHES = (9.0, 5.0)
COLOURS = {"eagle3": "tab:blue", "dflash2": "tab:orange", "dspark": "tab:green"}


def expected_accepted(position_accept: list[float], depth: int | None = None) -> float:
    """Sum over k of P(first k drafts accepted), over the first `depth` positions (all when None)."""
    total, survive = 0.0, 1.0
    for p in position_accept[:depth]:
        survive *= p
        total += survive
    return total


def bench_expectations(benches: list[dict], depth: int | None = None) -> float:
    """Rounds-weighted mean of the per-benchmark expectations (one benchmark: its own)."""
    rounds = sum(b["rounds"] for b in benches)
    if not rounds:
        return 0.0
    return sum(expected_accepted(b["position_accept"], depth) * b["rounds"] for b in benches) / rounds


def fit_line(xs: list[float], ys: list[float]) -> dict:
    """Least squares y = a + b·log2(x): `b` is the change per doubling of x."""
    lx = [math.log2(x) for x in xs]
    n = len(lx)
    mx, my = sum(lx) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in lx)
    b = sum((x - mx) * (y - my) for x, y in zip(lx, ys, strict=True)) / sxx if sxx else 0.0
    a = my - b * mx
    resid = [y - (a + b * x) for x, y in zip(lx, ys, strict=True)]
    return {"intercept": a, "per_doubling": b, "rms_residual": math.sqrt(sum(r * r for r in resid) / n)}


def crossings(tokens: list[int], series: dict[str, list[float]], fits: dict[str, dict]) -> list[dict]:
    """For every pair of families: where the measured curves change order (between which sizes), and where
    their fitted lines meet (supervised tokens; None when parallel or when the lines met before 1 token), and
    which is ahead at the largest size (None on a tie)."""
    out = []
    for f, g in combinations(series, 2):
        diff = [a - b for a, b in zip(series[f], series[g], strict=True)]
        # A tie is no change of order: compare the signs of the sizes where the two differ.
        signed = [(i, d > 0) for i, d in enumerate(diff) if d != 0]
        measured = [[tokens[i], tokens[j]] for (i, a), (j, b) in pairwise(signed) if a != b]
        fa, fb = fits[f], fits[g]
        slope = fa["per_doubling"] - fb["per_doubling"]
        meet = None
        if abs(slope) > 1e-12:
            log2_x = (fb["intercept"] - fa["intercept"]) / slope
            meet = round(2.0**log2_x) if -1 < log2_x < 200 else None
        ahead = f if diff[-1] > 0 else g if diff[-1] < 0 else None
        out.append(
            {"pair": [f, g], "measured_between": measured, "fitted_meet_tokens": meet, "ahead_at_largest": ahead}
        )
    return out


def plot(rows: list[dict], fits: dict[str, dict], path: str | Path) -> None:
    """acc_len (solid, measured; dotted, fitted) and expected accepted/round + 1 (dashed) against tokens."""
    fig = Figure(figsize=INCHES, dpi=DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    families = list(dict.fromkeys(r["family"] for r in rows))
    for fam in families:
        mine = sorted((r for r in rows if r["family"] == fam), key=lambda r: r["supervised_tokens"])
        xs = [r["supervised_tokens"] for r in mine]
        colour = COLOURS.get(fam)
        ax.plot(xs, [r["acc_len"] for r in mine], marker="o", color=colour, label=f"{fam} acc_len")
        ax.plot(
            xs, [1 + r["expected_accepted"] for r in mine], ls="--", marker="x", color=colour, alpha=0.6,
            label=f"{fam} 1 + expected accepted/round",
        )  # fmt: skip
        fit = fits[fam]
        ax.plot(
            xs, [fit["intercept"] + fit["per_doubling"] * math.log2(x) for x in xs], ls=":", color=colour,
            label=f"{fam} fit: {fit['per_doubling']:+.3f} per doubling",
        )  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xlabel("supervised training tokens (log scale)")
    ax.set_ylabel("tokens per round")
    ax.set_title("Acceptance length against training data (same data and epochs per family)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.savefig(str(path), dpi=DPI)


def markdown(report: dict) -> str:
    """The results table and the fitted slopes of a `scaling.json`, as Markdown for the docs."""
    depth = report["depth"]
    lines = [
        f"| prompts | supervised tokens | drafter | drafts/round | acc_len | expected accepted/round "
        f"| … of the first {depth} | train s |",
        "|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(report["rows"], key=lambda r: (r["prompts"], report["families"].index(r["family"]))):
        lines.append(
            f"| {r['prompts']} | {r['supervised_tokens']:,} | {r['family']} | {r['drafts_per_round']} "
            f"| {r['acc_len']:.3f} | {r['expected_accepted']:.3f} | {r[f'expected_accepted_first_{depth}']:.3f} "
            f"| {r['train_seconds']:,.0f} |"
        )
    summary = report["summary"]
    if "acc_len" in summary:
        lines += ["", "| drafter | acc_len per doubling | expected accepted/round per doubling |", "|---|---:|---:|"]
        for fam, f in summary["acc_len"]["fits"].items():
            e = summary["expected_accepted"]["fits"][fam]
            lines.append(f"| {fam} | {f['per_doubling']:+.4f} | {e['per_doubling']:+.4f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    import json
    import sys

    print(markdown(json.loads(Path(sys.argv[1]).read_text())))
