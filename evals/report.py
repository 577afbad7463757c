"""Markdown tables of an evaluation and their Prefect artifacts.

`markdown_tables` renders the acceptance table (rows: drafter and sampling setting; columns: benchmarks and
overall), a tokens/s table, the serving sweep and DSpark's calibration line. `publish` shows them, with the PNG
plots, in the Prefect UI.

Images: `create_image_artifact` stores its `image_url` string unchecked and the UI draws it as `<img src=...>`,
so a `data:image/png;base64,` URL works and needs no image host. Each plot becomes its own image artifact
(`{key}-{plot-name}`), and the markdown artifact (`{key}`) embeds the same data URLs under the tables so one page
shows the whole report. The PNGs are tens of kB, so storing them twice in the Prefect database is cheap.
"""

import base64
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from draftsmith.evals.plots import require, series_label

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_KEY = re.compile(r"^[a-z0-9-]+$")  # Prefect's rule for artifact keys


def _num(value) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    return str(value) if isinstance(value, int) else f"{value:.4g}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def overall_acc_len(group: list[dict]) -> float:
    """acc_len over several benchmarks: 1 + all accepted drafts / all rounds (not a mean of per-bench acc_lens)."""
    rounds = sum(r["rounds"] for r in group)
    return 1.0 + sum(r["accepted"] for r in group) / max(1, rounds)


def acceptance_table(results: list[dict]) -> list[str]:
    """Rows: drafter and sampling setting; columns: each benchmark's acc_len, then overall."""
    if not results:
        raise ValueError("no results to tabulate")
    for i, r in enumerate(results):
        require(r, ("bench", "drafter", "acc_len", "rounds", "accepted"), f"results[{i}]")
    benches = list(dict.fromkeys(r["bench"] for r in results))
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["drafter"], r.get("temperature", 0.0), r.get("top_p", 1.0)), []).append(r)
    rows = []
    for (drafter, temperature, top_p), group in groups.items():
        by_bench = {r["bench"]: r["acc_len"] for r in group}
        cells = [f"{by_bench[b]:.3f}" if b in by_bench else "–" for b in benches]
        rows.append([str(drafter), f"{temperature:g}", f"{top_p:g}", *cells, f"**{overall_acc_len(group):.3f}**"])
    return _table(["drafter", "temperature", "top_p", *benches, "overall"], rows)


def throughput_table(results: list[dict]) -> list[str]:
    """Decoding tokens/s with and without speculation, measured in the same run, per benchmark."""
    several = len({(r.get("temperature", 0.0), r.get("top_p", 1.0)) for r in results}) > 1
    rows = []
    for i, r in enumerate(results):
        require(r["tokens_per_s"], ("baseline", "speculative"), f"results[{i}]['tokens_per_s']")
        base, spec = r["tokens_per_s"]["baseline"], r["tokens_per_s"]["speculative"]
        speedup = f"x{spec / base:.2f}" if base else "–"
        rows.append([series_label(r, several), str(r["bench"]), f"{base:.2f}", f"{spec:.2f}", speedup])
    # The harness's ratio, batched and in-process: not what a serving engine gains (`draftsmith speedup` measures that).
    return _table(["drafter", "bench", "baseline tok/s", "speculative tok/s", "harness ratio"], rows)


def _flatten(level: Mapping, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in level.items():
        if isinstance(v, Mapping):
            out |= _flatten(v, f"{prefix}{k}.")
        elif not isinstance(v, list | tuple):
            out[f"{prefix}{k}"] = v
    return out


def sweep_table(sweeps: list[dict]) -> list[str]:
    """One row per (drafter, speculation, concurrency); every scalar a level reports gets a column."""
    flat = []
    for i, s in enumerate(sweeps):
        require(s, ("drafter", "speculative", "levels"), f"sweeps[{i}]")
        for j, level in enumerate(s["levels"]):
            require(level, ("concurrency", "output_tokens_per_s"), f"sweeps[{i}]['levels'][{j}]")
            flat.append((s, _flatten(level)))
    columns = ["concurrency", "output_tokens_per_s"]
    for _, level in flat:
        columns += [k for k in level if k not in columns]
    rows = [
        [str(s["drafter"]), "on" if s["speculative"] else "off", *(_num(level.get(c, "–")) for c in columns)]
        for s, level in flat
    ]
    return _table(["drafter", "speculation", *columns], rows)


def calibration_line(calibration: Mapping) -> str:
    """DSpark's confidence head: ECE before and after sequential temperature scaling, AUROC when given."""
    require(dict(calibration), ("ece_before", "ece_after"), "calibration")
    line = (
        f"**DSpark calibration:** ECE {calibration['ece_before']:.4f} before, "
        f"{calibration['ece_after']:.4f} after sequential temperature scaling"
    )
    if calibration.get("auroc") is not None:
        line += f"; AUROC {calibration['auroc']:.4f}"
    if calibration.get("temperatures"):
        line += "; per-position temperatures " + ", ".join(f"{t:.3g}" for t in calibration["temperatures"])
    return line + "."


def markdown_tables(results: list[dict], sweeps: list[dict] | None = None, calibration: Mapping | None = None) -> str:
    """The evaluation report as markdown: acceptance, tokens/s, serving sweep, calibration."""
    lines = ["## Acceptance length", "", *acceptance_table(results), ""]
    if all("tokens_per_s" in r for r in results):
        lines += ["## Decoding tokens/s (same run, with and without speculation)", "", *throughput_table(results), ""]
    if sweeps:
        lines += ["## Serving sweep", "", *sweep_table(sweeps), ""]
    if calibration is not None:
        lines += [calibration_line(calibration), ""]
    return "\n".join(lines)


def png_data_url(path: str | Path) -> str:
    """`data:image/png;base64,...` for a PNG file; refuses anything that is not a PNG."""
    return png_bytes_url(Path(path).read_bytes(), str(path))


def png_bytes_url(data: bytes, name: str) -> str:
    """`data:image/png;base64,...` for a PNG's bytes; refuses anything that is not a PNG, naming `name`."""
    if not data.startswith(PNG_SIGNATURE):
        raise ValueError(f"{name} is not a PNG file (no PNG signature)")
    return "data:image/png;base64," + base64.b64encode(data).decode("ascii")


def _slug(name: str) -> str:
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", name.lower())).strip("-")


def in_prefect_run() -> bool:
    """True inside a flow or task run; reading the context never contacts or starts a server."""
    from prefect.context import FlowRunContext, TaskRunContext

    return FlowRunContext.get() is not None or TaskRunContext.get() is not None


def publish(
    results: list[dict],
    sweeps: list[dict] | None,
    calibration: Mapping | None,
    png_paths: Sequence[str | Path] | Mapping[str, str | Path],
    *,
    key: str,
) -> list[str]:
    """Create the report's Prefect artifacts when inside a flow or task run; returns the artifact keys created.

    Outside a run it returns `[]` having done nothing: creating an artifact there would make Prefect start a
    temporary server. `png_paths` maps plot names to files (a plain sequence is named by file stem).
    """
    if not _KEY.match(key):
        raise ValueError(f"artifact key {key!r} must only contain lowercase letters, numbers and dashes")
    if not in_prefect_run():
        return []
    from prefect import artifacts

    named = dict(png_paths) if isinstance(png_paths, Mapping) else {Path(p).stem: p for p in png_paths}
    urls = {name: png_data_url(p) for name, p in named.items()}
    markdown = markdown_tables(results, sweeps, calibration)
    if urls:
        markdown += "\n## Plots\n\n" + "\n\n".join(f"### {name}\n\n![{name}]({url})" for name, url in urls.items())
    artifacts.create_markdown_artifact(markdown=markdown, key=key, description="Evaluation report")
    keys = [key]
    for name, url in urls.items():
        image_key = f"{key}-{_slug(name)}"
        artifacts.create_image_artifact(image_url=url, key=image_key, description=f"Evaluation plot: {name}")
        keys.append(image_key)
    return keys
