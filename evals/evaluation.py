"""One drafter's whole evaluation: every benchmark, and for DSpark the confidence calibration and dynamic
verification. Used by the pipeline's `evaluate` stage and by `draftsmith eval`.

DSpark: the confidence head is calibrated on its own prompts (built-in suites drawn with another seed), then
every benchmark is decoded with full blocks, which measures acceptance and gives the confidence records the
ECE before/after is measured on (never the calibration records themselves), and again with dynamic
verification (drafts cut where the calibrated prefix-survival product falls below the threshold).
"""

import functools

import torch

from draftsmith.core.progress import Progress
from draftsmith.drafters import confidence as cal
from draftsmith.drafters.speculative import Draft
from draftsmith.drafters.verify import Sampling
from draftsmith.evals import harness, suites
from draftsmith.evals.records import BenchPrompt


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
    progress: Progress | None = None,
) -> tuple[dict, list[dict], cal.Calibration | None]:
    """`(report, rows, calibration)`: report = {"benches": [...], "dynamic": [...] (DSpark), "confidence": {...}}.
    `progress` counts prompts decoded over every pass (DSpark: benchmarks, calibration, dynamic); without
    one, the terminal shows an `evaluate` bar of its own."""
    if progress is None:
        with Progress(None, desc="evaluate", unit="prompt") as own:
            return evaluate_drafter(
                target, tok, family, drafter, taps, kind=kind, benches=benches, settings=settings, eos=eos,
                calibration_prompts=calibration_prompts, threshold=threshold, progress=own,
            )  # fmt: skip
    n = sum(len(b) for b in benches.values())
    calib_benches = suites.builtin_suites(calibration_prompts, seed=settings.seed + 7919) if calibration_prompts else {}
    # DSpark decodes the benchmarks twice and the calibration prompts once: all of it is the total from the start.
    progress.set_total(n + (sum(len(b) for b in calib_benches.values()) + n if calib_benches else 0))
    progress.update(progress.done)  # the bar shows from here, not from the first batch of prompts decoded
    decoder = harness.Decoder(
        functools.partial(family.generate, target, drafter, taps, g=settings.g),
        taps,
        functools.partial(family.proposer, drafter, settings.g),
    )
    results, rows = harness.run_benches(target, tok, decoder, benches, settings, eos, kind, progress.advance)
    report: dict = {"benches": results}
    records = _records(rows)
    if not records or not calib_benches:
        return report, rows, None
    # Only a drafter with confidences (DSpark) gets here: a calibration pass and a dynamic pass follow.
    progress.note("calibration")
    _, calib_rows = harness.run_benches(target, tok, decoder, calib_benches, settings, eos, kind, progress.advance)
    s = settings.sampling
    fitted = cal.calibrate(
        _records(calib_rows), threshold=threshold, sampling={"temperature": s.temperature, "top_p": s.top_p}
    )
    report["confidence"] = _confidence_report(records, fitted, threshold)

    def truncate(d: Draft) -> int:
        assert d.confidence is not None, "drafters with a confidence head report it with every draft"
        return fitted.truncate(d.confidence)

    dynamic = decoder.with_truncate(truncate)
    progress.note("dynamic verification")
    dyn, _ = harness.run_benches(target, tok, dynamic, benches, settings, eos, f"{kind}+dynamic", progress.advance)
    report["dynamic"] = dyn
    return report, rows, fitted


def _confidence_report(records: list[cal.ConfidenceRecord], fitted: cal.Calibration, threshold: float) -> dict:
    """ECE and AUROC of the benchmark records before and after the fitted temperatures."""
    before, after = cal.confidence_metrics(records), cal.confidence_metrics(records, fitted.temperatures_tensor)
    return {
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


def settings_for(
    temperature: float, top_p: float, rule: str, max_new: int, g: int, seed: int, batch_size: int = 1
) -> harness.EvalSettings:
    return harness.EvalSettings(Sampling(temperature, top_p), rule, max_new, g, seed, batch_size)
