"""One drafter's whole evaluation: every benchmark, and for DSpark the confidence calibration and dynamic
verification. Used by the pipeline's `evaluate` stage and by `draftsmith eval`.

DSpark: the confidence head is calibrated on its own prompts (built-in suites drawn with another seed), then
every benchmark is decoded with full blocks, which measures acceptance and gives the confidence records the
ECE before/after is measured on (never the calibration records themselves), and again with dynamic
verification (drafts cut where the calibrated prefix-survival product falls below the threshold).
"""

import functools

import torch

from drafters.dspark import calibration as cal
from drafters.verify import Sampling
from evals import harness, suites
from evals.records import BenchPrompt


def _records(rows: list[dict]) -> list[cal.ConfidenceRecord]:
    return [cal.ConfidenceRecord(torch.tensor(c), n) for r in rows for c, n in r["confidence"]]


def evaluate_drafter(
    target,
    tok,
    family,
    drafter,
    taps: list[int],
    *,
    kind: str,
    benches: dict[str, list[BenchPrompt]],
    settings: harness.EvalSettings,
    eos: set[int],
    calibration_prompts: int = 0,
    threshold: float = 0.5,
) -> tuple[dict, list[dict], cal.Calibration | None]:
    """`(report, rows, calibration)`: report = {"benches": [...], "dynamic": [...] (DSpark), "confidence": {...}}."""
    generate = functools.partial(family.generate, target, drafter, taps, g=settings.g)
    results, rows = harness.run_benches(target, tok, generate, benches, settings, eos, kind)
    report: dict = {"benches": results}
    records = _records(rows)
    if not records or not calibration_prompts:
        return report, rows, None
    calib_benches = suites.builtin_suites(calibration_prompts, seed=settings.seed + 7919)
    _, calib_rows = harness.run_benches(target, tok, generate, calib_benches, settings, eos, kind)
    s = settings.sampling
    fitted = cal.calibrate(
        _records(calib_rows), threshold=threshold, sampling={"temperature": s.temperature, "top_p": s.top_p}
    )
    temps = fitted.temperatures_tensor
    before, after = cal.confidence_metrics(records), cal.confidence_metrics(records, temps)
    report["confidence"] = {
        "calibration_records": fitted.n_records,
        "eval_records": len(records),
        "temperatures": fitted.temperatures,
        "threshold": threshold,
        "ece_before": before["ece"],
        "ece_after": after["ece"],
        "auroc_before": before["auroc"],
        "auroc_after": after["auroc"],
        "reliability_before": before["reliability"],
        "reliability_after": after["reliability"],
    }
    dynamic = functools.partial(generate, truncate=lambda d: fitted.truncate(d.confidence))
    dyn, _ = harness.run_benches(target, tok, dynamic, benches, settings, eos, f"{kind}+dynamic")
    report["dynamic"] = dyn
    return report, rows, fitted


def settings_for(temperature: float, top_p: float, rule: str, max_new: int, g: int, seed: int) -> harness.EvalSettings:
    return harness.EvalSettings(Sampling(temperature, top_p), rule, max_new, g, seed)
