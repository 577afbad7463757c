"""Calibration of a drafter's confidence head (DSpark's) and the dynamic verification cut it drives
(algorithms.md §1(c)).

The confidence head gives slot k a logit c_k for "draft k is accepted, given drafts 0..k-1 were". Its prefix
survival `a_k = prod_{j<=k} sigmoid(c_j / T_j)` estimates P(drafts 0..k all accepted). Dynamic verification
keeps the longest prefix whose survival stays >= a threshold. A head trained with BCE against the soft target
`1 - TV` is not calibrated for hard accept/reject outcomes. Errors also compound along the product. So
Sequential Temperature Scaling (DSpark paper) fits one temperature per slot, in slot order. Each T_k is the grid
value that minimises the ECE of a_k against the observed prefix survival, with T_0..T_{k-1} already fixed.

Serving: `confidence_temperatures` (a list of Q floats at the top level of config.json) is the field that DSpark
checkpoints in the wild and a vLLM fork's `SequentialTemperatureScaler.from_config` read. Upstream vLLM's
`DSparkSpeculator` reads no temperature; it cuts the raw survival product at the speculative-config field
`dspark_confidence_threshold` (default 0.5). So the threshold travels in `--speculative-config`
(`speculative_config_fields`), not in the checkpoint.

Shape legend: N records (verification rounds), Q draft slots per round (= block size), G grid temperatures,
n scored (slot, round) pairs.
"""

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields

import torch

from draftsmith.core import storage

CALIBRATION_FILE = "calibration.json"
CONFIG_FIELD = "confidence_temperatures"
DEFAULT_THRESHOLD = 0.5  # vLLM's default `dspark_confidence_threshold`
DEFAULT_BINS = 15
# A slot whose prefix survived in fewer rounds than this keeps T = 1. Only those rounds carry its signal (the others
# are already settled failures), and a few dozen outcomes cannot pin a temperature: fitted on fewer, T ran to the
# grid's ends (0.05 or 20) on the SmolLM2 DSpark drafter's late slots.
DEFAULT_MIN_SURVIVORS = 30
SCHEMA_VERSION = 1


def default_grid() -> torch.Tensor:
    """121 log-spaced temperatures in [0.05, 20]: a 5% step, from 20x sharper to 20x flatter."""
    return torch.logspace(math.log10(0.05), math.log10(20.0), 121, dtype=torch.float64)


@dataclass(frozen=True)
class ConfidenceRecord:
    """One verification round: the confidence head's logits per draft slot `[Q]` and how many drafts the target
    accepted (slot k survived iff k < accepted).

    `proposed` is how many drafts were sent to verification (None means all Q); slots at or past it are left out
    of calibration. That includes rounds that failed before the cut, whose later slots are settled failures.
    Keeping those while the cut hides the survivors would bias the later slots' survival low. Dropping every
    round by its cut is unbiased whenever the cut depends only on the logits, as dynamic verification's does.
    """

    logits: torch.Tensor
    accepted: int
    proposed: int | None = None

    def __post_init__(self) -> None:
        logits = self.logits
        if not isinstance(logits, torch.Tensor) or logits.ndim != 1 or logits.numel() == 0:
            raise ValueError(f"ConfidenceRecord.logits: expected a non-empty 1-D tensor [Q], got {_describe(logits)}")
        if not logits.is_floating_point() or not bool(torch.isfinite(logits).all()):
            raise ValueError("ConfidenceRecord.logits: must be finite floating-point values")
        q = logits.numel()
        proposed = q if self.proposed is None else self.proposed
        if not 0 <= proposed <= q:
            raise ValueError(f"ConfidenceRecord.proposed: {self.proposed} is outside [0, Q={q}]")
        if not 0 <= self.accepted <= proposed:
            raise ValueError(f"ConfidenceRecord.accepted: {self.accepted} is outside [0, proposed={proposed}]")


def stack_records(records: Sequence[ConfidenceRecord]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(logits [N, Q] float64, survived [N, Q] bool, known [N, Q] bool)`: prefix survival of slot k and whether
    it was observed (see `ConfidenceRecord.proposed`)."""
    if len(records) == 0:
        raise ValueError("records: empty; calibration needs at least one verification round")
    q = records[0].logits.numel()
    for i, record in enumerate(records):
        if record.logits.numel() != q:
            raise ValueError(f"records[{i}].logits: Q={record.logits.numel()} but records[0] has Q={q}")
    logits = torch.stack([r.logits.detach().to("cpu", torch.float64) for r in records])
    slots = torch.arange(q)
    accepted = torch.tensor([r.accepted for r in records])[:, None]
    proposed = torch.tensor([q if r.proposed is None else r.proposed for r in records])[:, None]
    return logits, slots < accepted, slots < proposed


def _check_temperatures(temperatures: torch.Tensor, q: int, name: str = "temperatures") -> torch.Tensor:
    t = torch.as_tensor(temperatures, dtype=torch.float64)
    if t.ndim != 1 or t.numel() != q:
        raise ValueError(f"{name}: expected shape [{q}] (one per slot), got {list(t.shape)}")
    if not bool(torch.isfinite(t).all()) or not bool((t > 0).all()):
        raise ValueError(f"{name}: must be finite and > 0, got {t.tolist()}")
    return t


def survival(logits_Q: torch.Tensor, temperatures_Q: torch.Tensor) -> torch.Tensor:
    """Calibrated prefix survival `[..., Q]`: `cumprod_k sigmoid(logits[..., k] / T_k)` (non-increasing in k)."""
    logits = torch.as_tensor(logits_Q)
    if logits.ndim == 0:
        raise ValueError("logits_Q: expected [..., Q], got a scalar")
    t = _check_temperatures(temperatures_Q, logits.shape[-1], "temperatures_Q")
    # A calibration's temperatures are host values; the logits can come from a drafter on an accelerator.
    return torch.sigmoid(logits.to(torch.float64) / t.to(logits.device)).cumprod(-1)


def truncate(logits_Q: torch.Tensor, temperatures_Q: torch.Tensor, threshold: float) -> int:
    """Number of drafts to verify: the longest prefix whose calibrated survival stays >= `threshold`.

    0 is allowed. It means "verify no drafts this round": the target then still emits its one token (the
    bonus/correction). So decoding moves on and stays lossless, at plain autoregressive speed, which beats
    paying for a verification that is expected to fail. vLLM's allocator also starts every request at 0.
    threshold 0 keeps all Q.
    """
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold: must be in [0, 1], got {threshold}")
    a = survival(logits_Q, temperatures_Q)
    if a.ndim != 1:
        raise ValueError(f"logits_Q: truncate takes one round [Q], got shape {list(a.shape)}")
    below = (a < threshold).nonzero()
    return int(below[0, 0]) if below.numel() else a.numel()


def _check_pairs(probs: torch.Tensor, outcomes: torch.Tensor, bins: int) -> tuple[torch.Tensor, torch.Tensor]:
    p = torch.as_tensor(probs, dtype=torch.float64).flatten()
    y = torch.as_tensor(outcomes).flatten().to(torch.float64)
    if p.numel() == 0:
        raise ValueError("probs: empty")
    if y.numel() != p.numel():
        raise ValueError(f"outcomes: {y.numel()} values but probs has {p.numel()}")
    if not bool(((p >= 0) & (p <= 1)).all()):
        raise ValueError("probs: must lie in [0, 1]")
    if not bool(((y == 0) | (y == 1)).all()):
        raise ValueError("outcomes: must be 0/1 (or bool)")
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
        raise ValueError(f"bins: must be a positive int, got {bins!r}")
    return p, y


def _bin_sums(probs_Gn: torch.Tensor, y_n: torch.Tensor, bins: int) -> tuple[torch.Tensor, ...]:
    """Per-row equal-width bin `(count, sum of probs, sum of outcomes)`, each `[G, bins]`; p = 1 joins the top bin."""
    g = probs_Gn.shape[0]
    index = (probs_Gn * bins).long().clamp_(0, bins - 1) + bins * torch.arange(g)[:, None]
    index = index.flatten()

    def total(values: torch.Tensor | None) -> torch.Tensor:
        weights = None if values is None else values.flatten()
        return torch.bincount(index, weights, minlength=g * bins).to(torch.float64).view(g, bins)

    return total(None), total(probs_Gn), total(y_n.expand_as(probs_Gn))


def _ece_rows(probs_Gn: torch.Tensor, y_n: torch.Tensor, bins: int) -> torch.Tensor:
    """ECE `[G]` of each row of candidate probabilities against the same outcomes `[n]`.

    Per bin, |sum p - sum y| = count * |mean conf - accuracy|, so the count-weighted mean is sum |.| / n.
    """
    _, p_sum, y_sum = _bin_sums(probs_Gn, y_n, bins)
    return (p_sum - y_sum).abs().sum(-1) / probs_Gn.shape[1]


def ece(probs: torch.Tensor, outcomes: torch.Tensor, bins: int = DEFAULT_BINS) -> float:
    """Expected calibration error: equal-width bins on [0, 1], |mean confidence - accuracy| weighted by counts."""
    p, y = _check_pairs(probs, outcomes, bins)
    return float(_ece_rows(p[None], y, bins)[0])


def reliability(
    probs: torch.Tensor, outcomes: torch.Tensor, bins: int = DEFAULT_BINS
) -> list[tuple[float, float, float, float, int]]:
    """Reliability diagram rows `(bin_lo, bin_hi, mean_conf, accuracy, count)`, non-empty bins only (an empty bin
    has no accuracy, and leaving it out keeps results.json free of NaN)."""
    p, y = _check_pairs(probs, outcomes, bins)
    count, p_sum, y_sum = (t[0] for t in _bin_sums(p[None], y, bins))
    return [
        (b / bins, (b + 1) / bins, float(p_sum[b] / count[b]), float(y_sum[b] / count[b]), int(count[b]))
        for b in range(bins)
        if count[b] > 0
    ]


def auroc(scores: torch.Tensor, outcomes: torch.Tensor) -> float:
    """Area under the ROC curve, via Mann-Whitney U on ranks (tied scores share their average rank, i.e. count
    one half). 1 = every positive outranks every negative, 0.5 = chance, 0 = inverted."""
    s = torch.as_tensor(scores, dtype=torch.float64).flatten()
    y = torch.as_tensor(outcomes).flatten().to(torch.float64)
    if s.numel() == 0 or y.numel() != s.numel():
        raise ValueError(f"scores/outcomes: need equal non-empty lengths, got {s.numel()} and {y.numel()}")
    if not bool(((y == 0) | (y == 1)).all()):
        raise ValueError("outcomes: must be 0/1 (or bool)")
    n_pos = int(y.sum())
    n_neg = y.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        raise ValueError(f"outcomes: all {'negative' if n_pos == 0 else 'positive'}; AUROC needs both classes")
    _, inverse, counts = torch.unique(s, sorted=True, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).to(torch.float64)  # 1-based rank of the last member of each tie group
    ranks = (ends - (counts.to(torch.float64) - 1) / 2)[inverse]
    u = float(ranks[y == 1].sum()) - n_pos * (n_pos + 1) / 2
    return u / (n_pos * n_neg)


def survival_pairs(
    records: Sequence[ConfidenceRecord], temperatures: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(survival probs [n], prefix survived [n] bool)` over every observed (round, slot) pair; temperatures None
    scores the raw head (all T = 1)."""
    logits, survived, known = stack_records(records)
    t = torch.ones(logits.shape[1], dtype=torch.float64) if temperatures is None else temperatures
    return survival(logits, t)[known], survived[known]


def fit_temperatures(
    records: Sequence[ConfidenceRecord],
    grid: Sequence[float] | torch.Tensor | None = None,
    bins: int = DEFAULT_BINS,
    min_survivors: int = DEFAULT_MIN_SURVIVORS,
) -> torch.Tensor:
    """Sequential temperature scaling: `[Q]` temperatures, fitted slot by slot.

    T_k = the grid value that minimises the ECE of `prev * sigmoid(c_k / T)` against "prefix 0..k survived", with
    `prev` = the survival through slot k-1 under the already fitted T_0..T_{k-1}. Ties (flat ECE, e.g. saturated
    logits) go to the value nearest 1, so a slot with no signal is left as the head trained it. So is a slot whose
    prefix 0..k-1 survived in fewer than `min_survivors` observed rounds: too few outcomes to fit on.
    """
    logits, survived, known = stack_records(records)
    g = default_grid() if grid is None else torch.as_tensor(grid, dtype=torch.float64).flatten()
    if g.numel() == 0 or not bool(torch.isfinite(g).all()) or not bool((g > 0).all()):
        raise ValueError("grid: must be a non-empty list of finite temperatures > 0")
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
        raise ValueError(f"bins: must be a positive int, got {bins!r}")
    if isinstance(min_survivors, bool) or not isinstance(min_survivors, int) or min_survivors < 0:
        raise ValueError(f"min_survivors: must be an int >= 0, got {min_survivors!r}")
    # Nearest-to-1 first, so argmin's first minimum is the tie-break.
    g = g[torch.argsort(g.log().abs(), stable=True)]
    prev = torch.ones(logits.shape[0], dtype=torch.float64)
    fitted = []
    for k in range(logits.shape[1]):
        rows = known[:, k]
        if not bool(rows.any()):
            raise ValueError(f"records: no round observed slot {k}; verify full blocks when collecting calibration")
        alive = rows if k == 0 else rows & survived[:, k - 1]
        if int(alive.sum()) < min_survivors:
            best = torch.tensor(1.0, dtype=torch.float64)
        else:
            candidates = prev[rows] * torch.sigmoid(logits[rows, k][None] / g[:, None])  # [G, n]
            best = g[int(_ece_rows(candidates, survived[rows, k].to(torch.float64), bins).argmin())]
        fitted.append(float(best))
        prev = prev * torch.sigmoid(logits[:, k] / best)
    return torch.tensor(fitted, dtype=torch.float64)


@dataclass(frozen=True)
class Calibration:
    """A fitted calibration, saved as JSON next to the checkpoint (`CALIBRATION_FILE`).

    ece_before / ece_after: ECE of the survival product over all observed (round, slot) pairs with T = 1 and with
    the fitted temperatures (None when only temperatures were imported from a foreign config). `sampling` records
    the decoding setting the records came from (e.g. {"temperature": 1.0, "top_p": 0.95}): acceptance depends on
    it, so a calibration applies to that setting. `min_survivors` is the fit's floor below which a slot kept T = 1.
    """

    temperatures: list[float]
    threshold: float = DEFAULT_THRESHOLD
    bins: int = DEFAULT_BINS
    ece_before: float | None = None
    ece_after: float | None = None
    n_records: int | None = None
    sampling: dict[str, float] = field(default_factory=dict)
    min_survivors: int = DEFAULT_MIN_SURVIVORS

    def __post_init__(self) -> None:
        temps = list(self.temperatures)
        if not temps:
            raise ValueError("Calibration.temperatures: empty; expected one temperature per slot")
        _check_temperatures(torch.tensor(temps, dtype=torch.float64), len(temps), "Calibration.temperatures")
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"Calibration.threshold: must be in [0, 1], got {self.threshold}")
        if isinstance(self.bins, bool) or not isinstance(self.bins, int) or self.bins < 1:
            raise ValueError(f"Calibration.bins: must be a positive int, got {self.bins!r}")
        object.__setattr__(self, "temperatures", [float(t) for t in temps])

    @property
    def temperatures_tensor(self) -> torch.Tensor:
        return torch.tensor(self.temperatures, dtype=torch.float64)

    def survival(self, logits_Q: torch.Tensor) -> torch.Tensor:
        return survival(logits_Q, self.temperatures_tensor)

    def truncate(self, logits_Q: torch.Tensor) -> int:
        return truncate(logits_Q, self.temperatures_tensor, self.threshold)

    def to_dict(self) -> dict:
        return {"schema_version": SCHEMA_VERSION, "method": "sequential_temperature_scaling", **asdict(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, data: dict) -> "Calibration":
        if not isinstance(data, dict):
            raise ValueError(f"calibration: expected a JSON object, got {type(data).__name__}")
        version = data.get("schema_version", SCHEMA_VERSION)
        if version != SCHEMA_VERSION:
            raise ValueError(f"calibration.schema_version: {version} is not supported (expected {SCHEMA_VERSION})")
        if "temperatures" not in data:
            raise ValueError("calibration.temperatures: missing")
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known - {"schema_version", "method"}
        if unknown:
            raise ValueError(f"calibration: unknown fields {sorted(unknown)}")
        temps = data["temperatures"]
        if not isinstance(temps, list) or not all(isinstance(t, int | float) for t in temps):
            raise ValueError(f"calibration.temperatures: expected a list of numbers, got {temps!r}")
        return cls(**{k: v for k, v in data.items() if k in known})

    @classmethod
    def from_json(cls, text: str | bytes) -> "Calibration":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"calibration: not valid JSON ({exc})") from exc
        return cls.from_dict(data)


def calibrate(
    records: Sequence[ConfidenceRecord],
    threshold: float = DEFAULT_THRESHOLD,
    grid: Sequence[float] | torch.Tensor | None = None,
    bins: int = DEFAULT_BINS,
    sampling: dict[str, float] | None = None,
    min_survivors: int = DEFAULT_MIN_SURVIVORS,
) -> Calibration:
    """Fit the temperatures on `records` and measure the survival ECE before (T = 1) and after."""
    temps = fit_temperatures(records, grid, bins, min_survivors)
    before = ece(*survival_pairs(records), bins=bins)
    after = ece(*survival_pairs(records, temps), bins=bins)
    sampling = dict(sampling or {})
    return Calibration(temps.tolist(), threshold, bins, before, after, len(records), sampling, min_survivors)


def confidence_metrics(
    records: Sequence[ConfidenceRecord], temperatures: torch.Tensor | None = None, bins: int = DEFAULT_BINS
) -> dict:
    """`{"ece", "auroc", "reliability", "pairs"}` of the survival product (raw head when temperatures is None).
    AUROC is None when every observed slot survived, or none did."""
    probs, outcomes = survival_pairs(records, temperatures)
    try:
        area = auroc(probs, outcomes)
    except ValueError:
        area = None
    rows = [list(r) for r in reliability(probs, outcomes, bins)]
    return {"ece": ece(probs, outcomes, bins), "auroc": area, "reliability": rows, "pairs": int(probs.numel())}


def calibration_config(calibration: Calibration) -> dict:
    """Fields to merge into the top level of the exported config.json."""
    return {CONFIG_FIELD: list(calibration.temperatures)}


def speculative_config_fields(calibration: Calibration) -> dict:
    """Fields to merge into vLLM's `--speculative-config` for the dynamic cut.

    Upstream vLLM applies this threshold to the *raw* survival product. Calibrated and raw cuts agree only where
    the temperatures are close to 1.
    """
    return {"dspark_confidence_threshold": calibration.threshold}


def read_calibration(config: dict) -> Calibration | None:
    """The calibration an exported config.json carries: the full record under `draftsmith.calibration` (checked
    against the top-level `confidence_temperatures`), else the bare temperatures of a foreign checkpoint (with the
    default threshold), else None."""
    ours = (config.get("draftsmith") or {}).get("calibration")
    temps = config.get(CONFIG_FIELD)
    if ours is not None:
        calibration = Calibration.from_dict(ours)
        if temps is not None and [float(t) for t in temps] != calibration.temperatures:
            raise ValueError(f"{CONFIG_FIELD} {temps} != draftsmith.calibration.temperatures")
        return calibration
    if temps is None:
        return None
    if not isinstance(temps, list):
        raise ValueError(f"{CONFIG_FIELD}: expected a list of numbers, got {temps!r}")
    return Calibration([float(t) for t in temps])


def save_calibration(calibration: Calibration, folder: str) -> str:
    """Write `calibration.json` into `folder` (local or s3://); returns its URL."""
    url = storage.join(folder, CALIBRATION_FILE)
    storage.write_bytes(url, calibration.to_json().encode())
    return url


def load_calibration(folder: str) -> Calibration:
    url = storage.join(folder, CALIBRATION_FILE)
    if not storage.exists(url):
        raise FileNotFoundError(f"{url}: no calibration saved with this checkpoint")
    return Calibration.from_json(storage.read_bytes(url))


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor of shape {list(value.shape)}"
    return type(value).__name__
