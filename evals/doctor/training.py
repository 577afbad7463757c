"""Checks on the trainer's own record: training health (`train/metrics.jsonl`) and the generalisation gap
(training-batch accuracy against the evaluation's measured acceptance, supervised tokens against parameters).

Thresholds, and why they sit where they do, are in `docs/doctor.md`.
"""

import math

from draftsmith.evals.doctor import findings as F
from draftsmith.evals.doctor.facts import RunFacts
from draftsmith.evals.doctor.findings import Finding

METRICS = "train/metrics.jsonl"
MIN_STEPS = 20  # fewer records than this make every trend below noise
DIVERGED = 1.5  # end-of-run loss over the run's best window
STILL_FALLING = 0.02  # relative drop between the last two tenths of the run
BARELY_MOVED = 0.95  # end loss over start loss
LR_NOT_DECAYED = 0.9  # last lr over peak lr
SKIPPED_WARN = 0.01  # share of optimizer steps dropped for a non-finite loss or gradient
GAP_WARN = 0.15  # first-draft acceptance: training batches minus the held-out evaluation, absolute
TOKENS_PER_PARAM = 1.0  # supervised tokens per trainable drafter parameter below which data is the limit


def _window(values: list[float], lo: float, hi: float) -> float:
    """Mean of the values between fractions `lo` and `hi` of the run (at least one value)."""
    n = len(values)
    a, b = int(n * lo), max(int(n * lo) + 1, int(n * hi))
    part = values[a:b]
    return sum(part) / len(part)


def training_health(f: RunFacts) -> list[Finding]:
    """Loss divergence, skipped steps, an lr that never decayed, a curve still falling or flat from early on."""
    check = "training-health"
    if "train" not in f.manifests:
        return [F.missing(check, "the run has no finished train stage", "draftsmith run RECIPE")]
    if not f.metrics:
        return [F.missing(check, f"{METRICS} is absent", "train again; the trainer writes it every step")]
    records = f.metrics
    out = _skipped(check, records)
    losses = [float(r["loss"]) for r in records if not r.get("skipped") and "loss" in r]
    # A skipped step's non-finite loss was dropped by the trainer (counted above); one it kept was applied.
    bad = [r["step"] for r in records if "loss" in r and not r.get("skipped") and not math.isfinite(float(r["loss"]))]
    losses = [x for x in losses if math.isfinite(x)]
    if bad:
        out.append(F.error(check, f"{len(bad)} steps recorded a non-finite loss", f"{METRICS}: loss at steps "
                           f"{bad[:5]}", fix=f"lower train.lr{_now(f, 'lr')}; look for broken samples"))  # fmt: skip
    if len(losses) < MIN_STEPS:
        out.append(F.info(check, f"only {len(losses)} optimizer steps recorded: too few to judge the loss curve",
                          f"{METRICS}: {len(records)} records", fix="train.epochs, or select.num_prompts"))  # fmt: skip
        return out
    shape = _curve(check, f, losses, records) + _lr(check, f, records)
    out += shape
    if not shape and not any(x.severity in ("warn", "error") for x in out):
        out.append(F.ok(check, "the loss fell and settled; the lr decayed", _loss_line(losses)))
    return out


def _now(f: RunFacts, name: str) -> str:
    if f.recipe is None:
        return ""
    return f" (now {getattr(f.recipe.train, name)})"


def _loss_line(losses: list[float]) -> str:
    return (
        f"{METRICS}: loss {_window(losses, 0, 0.1):.4g} over the first tenth of steps, "
        f"{_window(losses, 0.8, 0.9):.4g} over the ninth, {_window(losses, 0.9, 1.0):.4g} over the last"
    )


def _skipped(check: str, records: list[dict]) -> list[Finding]:
    skipped = int(records[-1].get("skipped_steps", 0) or 0)
    if not skipped:
        return []
    share = skipped / max(1, len(records))
    evidence = f"{METRICS}: skipped_steps {skipped} of {len(records)} steps ({share:.1%})"
    if share >= SKIPPED_WARN:
        return [F.warn(check, "many steps were dropped for a non-finite loss or gradient", evidence,
                       fix="lower train.lr or raise train.warmup_steps; look for broken samples")]  # fmt: skip
    return [F.info(check, "a few steps were dropped for a non-finite loss or gradient", evidence)]


def _curve(check: str, f: RunFacts, losses: list[float], records: list[dict]) -> list[Finding]:
    start, end = _window(losses, 0, 0.1), _window(losses, 0.9, 1.0)
    prev = _window(losses, 0.8, 0.9)
    tenth = max(1, len(losses) // 10)
    best = min(sum(losses[i : i + tenth]) / tenth for i in range(0, len(losses) - tenth + 1))
    line = _loss_line(losses)
    if end > DIVERGED * best and end > best + 1e-6:
        return [F.error(check, "the loss diverged: it ends well above its best", line, f"{METRICS}: best window "
                        f"{best:.4g}, end {end:.4g} (x{end / best:.2f})",
                        fix=f"lower train.lr{_now(f, 'lr')} or raise train.warmup_steps")]  # fmt: skip
    if end >= BARELY_MOVED * start:
        return [F.warn(check, "the loss barely moved: the drafter learned little", line,
                       fix=f"raise train.lr{_now(f, 'lr')}; check the loss mask (tokenize) and the taps")]  # fmt: skip
    if prev > 0 and (prev - end) / prev > STILL_FALLING:
        epochs = f"train.epochs{_now(f, 'epochs')}"
        return [F.warn(check, "under-trained: the loss was still falling at the end", line,
                       f"{METRICS}: {(prev - end) / prev:.1%} lower over the last tenth of steps than the one before",
                       fix=f"raise {epochs}; acceptance usually follows the loss down")]  # fmt: skip
    half = _window(losses, 0.2, 0.3)
    if half > 0 and (half - end) / half < STILL_FALLING and (start - half) / start > 0.05:
        return [F.info(check, "the loss was flat from early on: more epochs will not help", line,
                       f"{METRICS}: {(half - end) / half:.1%} lower at the end than at a quarter of the run",
                       fix="more data (select.num_prompts) or a larger drafter; fewer train.epochs")]  # fmt: skip
    return []


def _lr(check: str, f: RunFacts, records: list[dict]) -> list[Finding]:
    lrs = [float(r["lr"]) for r in records if "lr" in r]
    if not lrs:
        return []
    peak, last = max(lrs), lrs[-1]
    schedule = f.recipe.train.schedule if f.recipe is not None else None
    if peak <= 0 or last < LR_NOT_DECAYED * peak:
        return []
    evidence = f"{METRICS}: lr peaked at {peak:.3g} and ended at {last:.3g} ({last / peak:.0%} of peak)"
    if schedule == "constant":
        return [F.info(check, "the learning rate is constant (train.schedule: constant)", evidence,
                       fix="train.schedule: cosine usually ends at a lower loss")]  # fmt: skip
    return [F.warn(check, "the learning rate never decayed", evidence,
                   fix="train.schedule (cosine, linear, wsd) and train.min_lr_ratio; a resumed or cut-short run "
                       "(max_steps) stops before the decay")]  # fmt: skip


def _train_depth_acc(f: RunFacts) -> list[float]:
    m = f.manifests["train"].metrics
    return [float(m[f"acc_{k}"]) for k in range(64) if f"acc_{k}" in m]


def _params(f: RunFacts) -> int | None:
    """Trainable drafter parameters: the checkpoint's floating tensors (the frozen embedding is not saved)."""
    shapes = f.shapes()
    if not shapes:
        return None
    floating = {name: shape for name, (dtype, shape) in shapes.items() if dtype.startswith(("F", "BF"))}
    return sum(math.prod(shape) for shape in floating.values())


def generalisation_gap(f: RunFacts) -> list[Finding]:
    """First-draft accuracy on training batches against first-draft acceptance per benchmark, with the data
    volume behind the verdict."""
    check = "generalisation-gap"
    if "train" not in f.manifests or f.results is None:
        return [F.missing(check, "needs both the train stage and evaluate/results.json", "draftsmith run RECIPE")]
    acc = _train_depth_acc(f)
    if not acc:
        return [F.missing(check, "train/manifest.json records no acc_0", "train again with this version")]
    gaps = []
    for bench in f.results.get("benches", []):
        pos = bench.get("position_accept") or []
        if pos:
            gaps.append((bench["bench"], acc[0] - float(pos[0]), float(pos[0])))
    if not gaps:
        return [F.missing(check, "evaluate/results.json has no per-position acceptance", "rerun evaluate")]
    tokenized = f.manifests.get("tokenize")
    tokens = tokenized.counts.get("loss_tokens") if tokenized is not None else None
    params = _params(f)
    ratio = tokens / params if tokens and params else None
    epochs = f.recipe.train.epochs if f.recipe is not None else None
    volume = (
        f"tokenize/manifest.json counts.loss_tokens {tokens}, train/model.safetensors {params} trainable parameters "
        f"({ratio:.3g} supervised tokens per parameter)"
        if ratio is not None
        else "supervised tokens or parameter count not recorded"
    )
    held = [g for g in gaps if g[0] == "held-out"] or gaps
    bench, gap, measured = max(held, key=lambda g: g[1])
    depth = min(len(acc), int(f.results.get("draft_tokens_per_round") or len(acc)))
    simulated = 1 + sum(math.prod(acc[: k + 1]) for k in range(depth))
    acc_len = next(float(b["acc_len"]) for b in f.results["benches"] if b["bench"] == bench)
    evidence = [
        f"train/manifest.json metrics.acc_0 {acc[0]:.3f} (training batches, last steps)",
        f"evaluate/results.json benches[{bench}].position_accept[0] {measured:.3f}",
        f"simulated acc_len on training batches at {depth} drafts {simulated:.3f} (acc_0..acc_{depth - 1}), "
        f"measured on {bench} {acc_len:.3f}",
        "; ".join(f"{b} {1 - g / acc[0] if acc[0] else 0:.0%} of training" for b, g, _ in gaps),
        volume,
    ]
    if gap < GAP_WARN:
        return [F.ok(check, f"first-draft acceptance on {bench} is within {GAP_WARN:.2f} of training", *evidence)]
    data_bound = ratio is not None and ratio < TOKENS_PER_PARAM
    verdict = "more data" if data_bound or not epochs or epochs <= 1 else "more data or fewer epochs"
    fix = "select.num_prompts (more data)" + ("" if verdict == "more data" else f"; train.epochs (now {epochs})")
    return [F.warn(check, f"the drafter does not generalise: {verdict} ({bench}: {measured:.2f} measured against "
                   f"{acc[0]:.2f} on training batches)", *evidence, fix=fix)]  # fmt: skip
