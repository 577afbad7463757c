"""What the Prefect UI shows of a run: task runs named after what they work on, a markdown summary per
stage, and after training a link to the checkpoint with the commands that serve it.

Every publisher here is a no-op outside a Prefect flow or task run, so stage code may call them freely.
Artifact keys are `<run>-<what>` (the run is the run folder's name, by default the recipe's), so the
Artifacts page groups a run's artifacts and each key's latest version is that run's newest.
"""

import logging
import re
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from draftsmith.core import storage
from draftsmith.core.manifest import StageManifest

log = logging.getLogger(__name__)
_NOT_KEY = re.compile(r"[^a-z0-9]+")
_TOP_FILES = 5
_INFO_CHARS = 160


def artifact_key(*parts: str) -> str:
    """A valid Prefect artifact key (lowercase letters, digits, dashes) from free-text `parts`."""
    slugs = [_NOT_KEY.sub("-", part.lower()).strip("-") for part in parts]
    key = "-".join(s for s in slugs if s)
    if not key:
        raise ValueError(f"artifact key: {parts!r} holds no letters or digits")
    return key


def run_label(uri: str, *, parent: bool = False) -> str:
    """The last segment of `uri` (with `parent`, of its parent folder): a run folder's name is the run's."""
    parts = [p for p in uri.rstrip("/").split("/") if p]
    if parent:
        parts = parts[:-1]
    return parts[-1] if parts else uri


def in_prefect_run() -> bool:
    from prefect.context import FlowRunContext, TaskRunContext

    return FlowRunContext.get() is not None or TaskRunContext.get() is not None


def task_run_namer(name: str, param: str = "run_dir") -> Callable[..., str]:
    """A `task_run_name` callable: `name[<run>]`, the run read from the task's `param` (a run folder)."""

    def namer(parameters: dict[str, Any]) -> str:  # Prefect passes the call's parameters by this name
        value = parameters.get(param)
        return f"{name}[{run_label(str(value))}]" if value else name

    return namer


def _cell(value: Any) -> str:
    text = str(value)
    if len(text) > _INFO_CHARS:
        text = text[: _INFO_CHARS - 1] + "…"
    return text.replace("|", "\\|").replace("\n", " ")


def human_bytes(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} TiB"


def _lost(counts: dict[str, int]) -> int:
    return sum(n for k, n in counts.items() if k.startswith(("dropped.", "rejected.")))


def summary_markdown(manifest: StageManifest, *, started_at: datetime) -> str:
    """A stage's counts, rejects, sizes, metrics, provenance and timing, from its manifest alone.

    `started_at` (UTC, timezone-aware) is when the task began: a manifest older than that was reused.
    """
    created = datetime.fromisoformat(manifest.created_at)
    when = (
        f"Up to date: reused the result computed at {manifest.created_at} in {manifest.seconds:.1f} s."
        if created < started_at
        else f"Computed in {manifest.seconds:.1f} s."
    )
    total = sum(f.bytes for f in manifest.files)
    lines = [f"# {manifest.stage} · {run_label(manifest.uri, parent=True)}", "", when, ""]
    lines += [f"**{len(manifest.files)} files, {human_bytes(total)}** in `{manifest.uri}`."]
    if lost := _lost(manifest.counts):
        lines.append(f"**{lost} rows dropped or rejected** (see `dropped.*` / `rejected.*` below).")
    if manifest.counts:
        lines += ["", "| count | value |", "|---|---:|"]
        lines += [f"| {_cell(k)} | {v:,} |" for k, v in manifest.counts.items()]
    if manifest.metrics:
        lines += ["", "| metric | value |", "|---|---:|"]
        lines += [f"| {_cell(k)} | {v:.6g} |" for k, v in manifest.metrics.items()]
    if manifest.files:
        biggest = sorted(manifest.files, key=lambda f: f.bytes, reverse=True)[:_TOP_FILES]
        lines += ["", "| largest files | size |", "|---|---:|"]
        lines += [f"| `{_cell(f.name)}` | {human_bytes(f.bytes)} |" for f in biggest]
    if manifest.info:
        lines += ["", "| provenance | value |", "|---|---|"]
        lines += [f"| {_cell(k)} | `{_cell(v)}` |" for k, v in manifest.info.items()]
    lines += ["", f"Stage key `{manifest.key[:16]}`.", ""]
    return "\n".join(lines)


def publish_summary(manifest: StageManifest, *, started_at: datetime) -> str | None:
    """The stage summary as artifact `<run>-<stage>-summary`; its key, or None outside a Prefect run."""
    if not in_prefect_run():
        return None
    from prefect.artifacts import create_markdown_artifact

    key = artifact_key(run_label(manifest.uri, parent=True), manifest.stage, "summary")
    markdown = summary_markdown(manifest, started_at=started_at)
    create_markdown_artifact(markdown=markdown, key=key, description=f"{manifest.stage}: counts, sizes, time")
    return key


def link_of(uri: str) -> str:
    """A clickable form of `uri`: `file://` for local paths, the URL itself otherwise."""
    return Path(storage.local_path(uri)).resolve().as_uri() if storage.is_local(uri) else uri
