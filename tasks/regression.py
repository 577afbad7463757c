"""The nightly regression's judgement: a run's figures against its committed baseline, within bands.

A run's figures come from its train stage's `metrics.jsonl` (the loss per step) and its evaluate stage's
`results.json` (acc_len, greedy mismatches). Each figure becomes a `Check` with its band and PASS/FAIL;
`summary_markdown` is the table the flow publishes as the `nightly-regression` artifact. Health checks
(finite, decreasing, lossless) need no baseline. Baselines change only through `draftsmith baseline update`.
"""

import hashlib
import json
import math
import re
from datetime import UTC, datetime

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import Field

from draftsmith.core import storage
from draftsmith.core.config import NightlyConfig, PipelineConfig, load_recipe
from draftsmith.core.config.base import StrictModel
from draftsmith.core.config.nightly import Bands

ARTIFACT_KEY = "nightly-regression"


class Figures(StrictModel):
    """What one finished nightly run shows."""

    steps: int = Field(ge=0, description="Optimizer steps recorded in metrics.jsonl.")
    bad_steps: int = Field(ge=0, description="Steps whose loss was non-finite (null) or that were skipped.")
    loss_curve: list[float | None] = Field(description="Mean finite loss of each equal window of steps.")
    windows: list[tuple[int, int]] = Field(description="First and last step of each window.")
    final_loss: float | None = Field(description="Loss of the last step (null: non-finite).")
    acc_len: float = Field(description="Evaluated acc_len, all benchmarks together.")
    mismatched_outputs: int | None = Field(description="Greedy outputs that differ from plain decoding (null: T>0).")


class Baseline(StrictModel):
    """A committed `deployments/baselines/nightly-<drafter>.json`."""

    recipe: str = Field(description="Name of the nightly recipe the figures come from.")
    drafter: str = Field(description="Drafter kind.")
    recipe_sha256: str = Field(description="Hash of the resolved recipe the baseline was recorded with.")
    steps: int = Field(ge=1, description="Optimizer steps of the recorded run.")
    loss_curve: list[float] = Field(min_length=2, description="Window means of the loss (see Bands.curve_windows).")
    final_loss: float = Field(description="Loss of the last step.")
    acc_len: float = Field(ge=1.0, description="Evaluated acc_len.")
    recorded_from: str = Field(description="Run folder the figures were read from.")
    recorded_at: str = Field(description="UTC time of `draftsmith baseline update`.")
    torch_version: str = Field(description="torch version of the recording machine.")


class Check(StrictModel):
    """One figure against its band."""

    drafter: str = Field(description="Drafter kind.")
    figure: str = Field(description="What is measured, e.g. `loss window 2/6 (steps 10-18)`.")
    value: float | None = Field(description="This run's value (null: missing or non-finite).")
    baseline: float | None = Field(None, description="The baseline's value, if the figure has one.")
    low: float | None = Field(None, description="Lowest passing value (null: unbounded).")
    high: float | None = Field(None, description="Highest passing value (null: unbounded).")
    why: str = Field("", description="What a failure means, shown beside FAIL.")

    @property
    def passed(self) -> bool:
        if self.value is None or not math.isfinite(self.value):
            return False
        return (self.low is None or self.value >= self.low) and (self.high is None or self.value <= self.high)


def nightly_recipe(cfg: NightlyConfig, drafter: str) -> PipelineConfig:
    """`<recipe_dir>/nightly-<drafter>.yaml` with the config's overrides."""
    return load_recipe(storage.join(cfg.recipe_dir, f"nightly-{drafter}.yaml"), dict(cfg.overrides))


def recipe_sha256(cfg: PipelineConfig) -> str:
    """Hash of the fields the recipe sets: a new config field with a default does not change it, an edit does."""
    return hashlib.sha256(
        json.dumps(cfg.model_dump(mode="json", exclude_unset=True), sort_keys=True).encode()
    ).hexdigest()


def _finite(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def window_bounds(n: int, windows: int) -> list[tuple[int, int]]:
    """`windows` contiguous index ranges `[start, end)` covering `n` items, sizes differing by at most one."""
    if n < windows:
        raise ValueError(f"nightly: {n} training steps cannot fill {windows} loss windows (bands.curve_windows)")
    return [(i * n // windows, (i + 1) * n // windows) for i in range(windows)]


def loss_figures(records: list[dict], windows: int) -> dict:
    """Steps, bad steps, window means and final loss of metrics.jsonl records (non-finite losses are null)."""
    records = sorted(records, key=lambda r: r["step"])
    losses = [_finite(r.get("loss")) for r in records]
    bad = sum(1 for r, loss in zip(records, losses, strict=True) if loss is None or r.get("skipped"))
    curve, steps = [], []
    for start, end in window_bounds(len(records), windows):
        finite = [v for v in losses[start:end] if v is not None]
        curve.append(sum(finite) / len(finite) if finite else None)
        steps.append((records[start]["step"], records[end - 1]["step"]))
    return {"steps": len(records), "bad_steps": bad, "loss_curve": curve, "windows": steps, "final_loss": losses[-1]}


def read_figures(run_dir: str, windows: int) -> Figures:
    """The figures of a finished pipeline run in `run_dir` (its train and evaluate stages)."""
    metrics = storage.join(run_dir, "train", "metrics.jsonl")
    results = storage.join(run_dir, "evaluate", "results.json")
    for url in (metrics, results):
        if not storage.exists(url):
            raise FileNotFoundError(f"nightly: {url} is missing; the run in {run_dir} did not finish")
    records = storage.read_jsonl(metrics)
    if not records:
        raise ValueError(f"nightly: {metrics} holds no training steps")
    evaluated = storage.read_json(results)
    return Figures(
        **loss_figures(records, windows),
        acc_len=evaluated["acc_len"]["overall"],
        mismatched_outputs=evaluated.get("mismatched_outputs"),
    )


def health_checks(drafter: str, fig: Figures, bands: Bands) -> list[Check]:
    """Finite, decreasing and lossless: rules that hold for any good run, baseline or not."""
    first, last = fig.loss_curve[0], fig.loss_curve[-1]
    drop = 1.0 - last / first if first and last is not None else None
    checks = [
        Check(drafter=drafter, figure="non-finite or skipped steps", value=fig.bad_steps, low=0, high=0,
              why="the loss or a gradient was NaN/inf"),
        Check(drafter=drafter, figure="loss drop, first to last window", value=drop, low=bands.min_loss_drop,
              why="the loss is not decreasing"),
    ]  # fmt: skip
    if fig.mismatched_outputs is not None:
        checks.append(
            Check(drafter=drafter, figure="greedy outputs differing from plain decoding",
                  value=fig.mismatched_outputs, low=0, high=0, why="speculative decoding is not lossless")
        )  # fmt: skip
    return checks


def _rel(drafter: str, figure: str, value: float | None, base: float, rel: float, why: str) -> Check:
    half = abs(base) * rel
    return Check(drafter=drafter, figure=figure, value=value, baseline=base, low=base - half, high=base + half, why=why)


def baseline_checks(drafter: str, fig: Figures, base: Baseline, bands: Bands) -> list[Check]:
    """Steps exactly, each loss window and the final loss within `loss_rel`, acc_len within `acc_len_abs`."""
    if len(base.loss_curve) != len(fig.loss_curve):
        raise ValueError(
            f"nightly: the {drafter} baseline has {len(base.loss_curve)} loss windows but bands.curve_windows is "
            f"{len(fig.loss_curve)}; run `draftsmith baseline update` after changing it"
        )
    checks = [
        Check(drafter=drafter, figure="optimizer steps", value=fig.steps, baseline=base.steps, low=base.steps,
              high=base.steps, why="the training data or the batch plan changed"),
    ]  # fmt: skip
    n = len(fig.loss_curve)
    for i, (value, ref, (a, b)) in enumerate(zip(fig.loss_curve, base.loss_curve, fig.windows, strict=True)):
        label = f"loss window {i + 1}/{n} (steps {a}-{b})"
        checks.append(_rel(drafter, label, value, ref, bands.loss_rel, "the loss curve left its band"))
    checks.append(
        _rel(drafter, f"final loss (step {fig.windows[-1][1]})", fig.final_loss, base.final_loss, bands.loss_rel,
             "the final loss left its band")
    )  # fmt: skip
    lo, hi = base.acc_len - bands.acc_len_abs, base.acc_len + bands.acc_len_abs
    checks.append(
        Check(drafter=drafter, figure="acc_len", value=fig.acc_len, baseline=base.acc_len, low=lo, high=hi,
              why="acceptance left its band")
    )  # fmt: skip
    return checks


def baseline_path(baseline_dir: str, drafter: str) -> str:
    return storage.join(baseline_dir, f"nightly-{drafter}.json")


def load_baseline(baseline_dir: str, drafter: str) -> Baseline | None:
    url = baseline_path(baseline_dir, drafter)
    if not storage.exists(url):
        return None
    try:
        return Baseline.model_validate(storage.read_json(url))
    except ValueError as err:
        raise ValueError(f"{url}: not a valid baseline: {err}") from None


def make_baseline(cfg: PipelineConfig, fig: Figures, run_dir: str, bands: Bands) -> Baseline:
    """A baseline from a healthy run; a run failing a health check cannot become one."""
    failed = [c for c in health_checks(cfg.drafter.kind, fig, bands) if not c.passed]
    if failed or fig.final_loss is None or any(v is None for v in fig.loss_curve):
        what = ", ".join(f"{c.figure} = {_num(c.value)}" for c in failed) or "a non-finite loss window"
        raise ValueError(f"baseline: the {cfg.drafter.kind} run in {run_dir} is not healthy ({what}); not recorded")
    return Baseline(
        recipe=cfg.name,
        drafter=cfg.drafter.kind,
        recipe_sha256=recipe_sha256(cfg),
        steps=fig.steps,
        loss_curve=[round(v, 6) for v in fig.loss_curve if v is not None],  # none is (checked above)
        final_loss=round(fig.final_loss, 6),
        acc_len=fig.acc_len,
        recorded_from=run_dir,
        recorded_at=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        torch_version=torch.__version__,
    )


def _delta(old: float, new: float) -> str:
    if old == new:
        return f"{_num(new)} (unchanged)"
    rel = f", {(new - old) / abs(old):+.2%}" if old else ""
    return f"{_num(old)} -> {_num(new)} ({new - old:+.4f}{rel})"


def baseline_diff(old: Baseline | None, new: Baseline) -> list[str]:
    """One line per compared figure, old -> new; every figure is new when there was no baseline."""
    if old is None:
        figures = {"steps": new.steps, "final loss": new.final_loss, "acc_len": new.acc_len}
        curve = ", ".join(_num(v) for v in new.loss_curve)
        return [f"{k}: {_num(v)} (new)" for k, v in figures.items()] + [f"loss curve: {curve} (new)"]
    lines = [f"steps: {_delta(old.steps, new.steps)}"]
    if len(old.loss_curve) == len(new.loss_curve):
        n = len(new.loss_curve)
        lines += [
            f"loss window {i + 1}/{n}: {_delta(a, b)}"
            for i, (a, b) in enumerate(zip(old.loss_curve, new.loss_curve, strict=True))
        ]
    else:
        lines.append(f"loss curve: {len(old.loss_curve)} -> {len(new.loss_curve)} windows (bands.curve_windows)")
    lines += [f"final loss: {_delta(old.final_loss, new.final_loss)}", f"acc_len: {_delta(old.acc_len, new.acc_len)}"]
    if old.recipe_sha256 != new.recipe_sha256:
        lines.append(f"recipe: changed ({old.recipe_sha256[:12]} -> {new.recipe_sha256[:12]})")
    if old.torch_version != new.torch_version:
        lines.append(f"torch: {old.torch_version} -> {new.torch_version}")
    return lines


def recipe_note(recipe: PipelineConfig, baseline_dir: str, overrides: dict) -> str:
    """Whether the recipe run is the one the baseline was recorded with (overrides or edits make it differ)."""
    base = load_baseline(baseline_dir, recipe.drafter.kind)
    if base is None:
        return f"`{recipe.name}`, no baseline recorded"
    if base.recipe_sha256 == recipe_sha256(recipe):
        return f"`{recipe.name}` as recorded {base.recorded_at} (torch {base.torch_version})"
    changes = ", ".join(f"{k}={v}" for k, v in overrides.items()) or "none"
    return f"`{recipe.name}` differs from the recipe recorded {base.recorded_at} (overrides: {changes})"


def judge(cfg: PipelineConfig, run_dir: str, baseline_dir: str, bands: Bands) -> list[Check]:
    """Every check of one drafter's finished run."""
    kind = cfg.drafter.kind
    fig = read_figures(run_dir, bands.curve_windows)
    checks = health_checks(kind, fig, bands)
    base = load_baseline(baseline_dir, kind)
    if base is None:
        url = baseline_path(baseline_dir, kind)
        return [*checks, Check(drafter=kind, figure=f"baseline {url}", value=None, why="missing: record it with "
                               "`draftsmith baseline update`")]  # fmt: skip
    return checks + baseline_checks(kind, fig, base, bands)


def pipeline_failed(drafter: str, message: str) -> Check:
    """The check standing for a drafter whose pipeline did not finish."""
    return Check(drafter=drafter, figure="pipeline", value=None, why=f"the run failed: {message}")


def _num(value: float | None) -> str:
    if value is None:
        return "—"
    return str(int(value)) if float(value).is_integer() and abs(value) < 1e6 else f"{value:.4f}"


def _band(c: Check) -> str:
    if c.low is None and c.high is None:
        return "—"
    if c.low == c.high:
        return f"= {_num(c.low)}"
    if c.high is None:
        return f">= {_num(c.low)}"
    if c.low is None:
        return f"<= {_num(c.high)}"
    return f"{_num(c.low)} .. {_num(c.high)}"


def summary_markdown(checks: list[Check], run_root: str, notes: dict[str, str]) -> str:
    """The `nightly-regression` artifact: the verdict first, then every figure with its band and result."""
    failed = [c for c in checks if not c.passed]
    if failed:
        head = f"# Nightly regression: FAIL ({len(failed)} of {len(checks)} figures out of band)"
        lines = [head, "", *(f"- **{c.drafter}**: {c.figure} = {_num(c.value)}, {c.why}" for c in failed)]
    else:
        lines = [f"# Nightly regression: PASS (all {len(checks)} figures in band)"]
    lines += ["", f"Runs: `{run_root}`", ""]
    lines += [f"- **{d}**: {note}" for d, note in notes.items()]
    lines += ["", "| drafter | figure | baseline | band | value | result |", "|---|---|---|---|---|---|"]
    for c in checks:
        verdict = "PASS" if c.passed else "**FAIL**"
        lines.append(f"| {c.drafter} | {c.figure} | {_num(c.baseline)} | {_band(c)} | {_num(c.value)} | {verdict} |")
    return "\n".join(lines) + "\n"


@task(name="regression", task_run_name="regression[{cfg.name}]", cache_policy=NO_CACHE)
def judge_task(cfg: PipelineConfig, run_dir: str, baseline_dir: str, bands: Bands) -> list[Check]:
    return judge(cfg, run_dir, baseline_dir, bands)


NIGHT_FOLDER = re.compile(r"^\d{8}T\d{6}Z$")  # what `draftsmith.flows.nightly.nightly_folder` names an unnamed night


def prune_nights(run_root: str, keep: int) -> list[str]:
    """Delete all but the newest `keep` timestamped night folders under `run_root` (0: keep all).

    Only `YYYYMMDDTHHMMSSZ` folders count, so a named run (`run_name`) or anything else there is left alone.
    Returns the deleted folders' URLs, oldest first.
    """
    if keep == 0:
        return []
    nights = sorted(n for n in storage.list_names(run_root) if NIGHT_FOLDER.match(n))
    doomed = [storage.join(run_root, n) for n in nights[:-keep]]
    for url in doomed:
        storage.remove_tree(url)
    return doomed
