"""DSpark confidence calibration: sequential temperature scaling recovers known miscalibration, ECE / reliability /
AUROC on hand-checked and synthetic data, the dynamic-verification cut, censoring, and the JSON / config carriers."""

import json
import math

import pytest
import torch

from draftsmith.drafters.confidence import (
    CONFIG_FIELD,
    Calibration,
    ConfidenceRecord,
    auroc,
    calibrate,
    calibration_config,
    confidence_metrics,
    ece,
    fit_temperatures,
    load_calibration,
    read_calibration,
    reliability,
    save_calibration,
    speculative_config_fields,
    stack_records,
    survival,
    truncate,
)

pytestmark = pytest.mark.unit

# Observed logit = true logit x factor: factor > 1 is overconfident, < 1 underconfident; the right T_k is the factor.
FACTORS = [2.0, 0.5, 3.0, 1.0, 0.7]


def synthetic_rounds(n: int, factors: list[float], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(head logits [n, Q], accepted [n])` from a known process: slot k's true conditional acceptance is
    sigmoid(z_k), z_k ~ N(1.5, 1.5^2) per round; the round accepts drafts until its first rejection."""
    g = torch.Generator().manual_seed(seed)
    q = len(factors)
    z = 1.5 + 1.5 * torch.randn(n, q, generator=g, dtype=torch.float64)
    ok = torch.rand(n, q, generator=g, dtype=torch.float64) < torch.sigmoid(z)
    accepted = torch.where(ok.all(1), q, (~ok).int().argmax(1))
    return (z * torch.tensor(factors, dtype=torch.float64)).float(), accepted


def to_records(logits: torch.Tensor, accepted: torch.Tensor, proposed: torch.Tensor | None = None) -> list:
    if proposed is None:
        return [ConfidenceRecord(row, int(a)) for row, a in zip(logits, accepted, strict=True)]
    return [ConfidenceRecord(row, int(min(a, p)), int(p)) for row, a, p in zip(logits, accepted, proposed, strict=True)]


@pytest.fixture(scope="module")
def miscalibrated():
    return synthetic_rounds(20000, FACTORS, seed=0)


def test_fit_recovers_known_temperatures_and_cuts_ece(miscalibrated):
    records = to_records(*miscalibrated)
    cal = calibrate(records)
    log_err = [abs(math.log(t / f)) for t, f in zip(cal.temperatures, FACTORS, strict=True)]
    # Fitted values with seed 0: [2.01, 0.497, 2.85, 1.00, 0.607]; later slots see fewer survivors, so more noise.
    assert max(log_err[:3]) < 0.1, cal.temperatures
    assert max(log_err) < 0.25, cal.temperatures
    # Measured: ECE 0.035 before, 0.005 after.
    assert cal.ece_before is not None and cal.ece_after is not None
    assert cal.ece_before > 0.025
    assert cal.ece_after < cal.ece_before / 4
    assert cal.n_records == 20000
    # ece_after is exactly what the fitted temperatures give.
    assert confidence_metrics(records, cal.temperatures_tensor)["ece"] == pytest.approx(cal.ece_after)


def test_calibrated_head_keeps_temperatures_near_one():
    records = to_records(*synthetic_rounds(10000, [1.0] * 4, seed=3))
    cal = calibrate(records)
    assert all(abs(math.log(t)) < 0.1 for t in cal.temperatures), cal.temperatures
    assert cal.ece_before is not None and cal.ece_after is not None
    assert cal.ece_before < 0.01 and cal.ece_after <= cal.ece_before + 1e-3


def test_cut_rounds_are_censored_not_counted_as_failures(miscalibrated):
    logits, accepted = miscalibrated
    proposed = torch.randint(1, len(FACTORS) + 1, (len(accepted),), generator=torch.Generator().manual_seed(1))
    censored = fit_temperatures(to_records(logits, accepted, proposed))
    assert all(abs(math.log(t / f)) < 0.1 for t, f in zip(censored[:4].tolist(), FACTORS[:4], strict=True)), censored
    # Ignoring the cut reads "not verified" as "rejected": later slots look hopeless and T runs off.
    naive = fit_temperatures(
        [ConfidenceRecord(r, int(min(a, p))) for r, a, p in zip(logits, accepted, proposed, strict=True)]
    )
    assert naive[2] > 2 * FACTORS[2]


def test_slots_with_few_surviving_prefixes_keep_temperature_one(miscalibrated):
    """Slot k is fitted on the rounds whose prefix 0..k-1 survived; below `min_survivors` of them it keeps T = 1."""
    logits, accepted = (t[:200] for t in miscalibrated)
    alive = [int((accepted >= k).sum()) for k in range(len(FACTORS))]  # survivors of prefix 0..k-1 (k=0: all)
    floor = sorted(alive)[2] + 1  # the last three slots fall below it, the first two do not
    fitted = fit_temperatures(to_records(logits, accepted), min_survivors=floor).tolist()
    free = fit_temperatures(to_records(logits, accepted), min_survivors=0).tolist()
    held = [k for k in range(len(FACTORS)) if alive[k] < floor]
    assert held == [2, 3, 4], alive
    assert [fitted[k] for k in held] == [1.0, 1.0, 1.0] and fitted[:2] == free[:2], (fitted, free)
    assert free[2] != 1.0  # slot 2 is 3x overconfident: fitted freely, it moves
    cal = calibrate(to_records(logits, accepted), min_survivors=floor)
    assert Calibration.from_json(cal.to_json()) == cal and cal.min_survivors == floor
    with pytest.raises(ValueError, match="min_survivors: must be an int >= 0"):
        fit_temperatures(to_records(logits, accepted), min_survivors=-1)


def test_stack_records_masks():
    zeros = torch.zeros(4)
    _, survived, known = stack_records(
        [ConfidenceRecord(zeros, 2, 2), ConfidenceRecord(zeros, 1, 3), ConfidenceRecord(zeros, 4)]
    )
    assert survived.tolist() == [[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]]
    assert known.tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]


def test_ece_hand_computed_and_reliability_rows():
    probs = torch.tensor([0.1, 0.1, 0.9, 0.9], dtype=torch.float64)
    outcomes = torch.tensor([0, 1, 1, 1])
    # bin [0.1, 0.2): conf 0.1 vs accuracy 0.5, 2 items; bin [0.9, 1]: 0.9 vs 1.0, 2 items -> (2*0.4 + 2*0.1) / 4.
    assert ece(probs, outcomes, bins=10) == pytest.approx(0.25)
    rows = reliability(probs, outcomes, bins=10)
    assert [r[4] for r in rows] == [2, 2]
    assert rows[0][:4] == pytest.approx((0.1, 0.2, 0.1, 0.5))
    assert rows[1][:4] == pytest.approx((0.9, 1.0, 0.9, 1.0))
    assert ece(torch.tensor([1.0]), torch.tensor([True])) == 0.0  # p = 1 lands in the top bin


def test_ece_of_calibrated_data_is_zero():
    exact = torch.tensor([0.25] * 4 + [0.75] * 4, dtype=torch.float64)
    assert ece(exact, torch.tensor([1, 0, 0, 0, 1, 1, 1, 0])) == pytest.approx(0.0, abs=1e-12)
    g = torch.Generator().manual_seed(0)
    p = torch.rand(200_000, generator=g, dtype=torch.float64)
    y = torch.rand(200_000, generator=g, dtype=torch.float64) < p
    assert ece(p, y) < 0.01
    assert ece(p, ~y) > 0.4  # the same scores against flipped outcomes are badly miscalibrated


def test_auroc_perfect_random_inverted_and_ties():
    g = torch.Generator().manual_seed(0)
    y = torch.rand(20000, generator=g) < 0.4
    noise = 0.1 * torch.rand(20000, generator=g)
    assert auroc(y.double() + noise, y) == 1.0
    assert auroc(-(y.double() + noise), y) == 0.0
    assert abs(auroc(torch.rand(20000, generator=g), y) - 0.5) < 0.02
    assert auroc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1])) == pytest.approx(0.75)
    # Ties count one half: pairs (0.5, 0.5) = 0.5, (0.5, 0.2) = 1, (0.9, *) = 1 + 1 -> 3.5 / 4.
    assert auroc(torch.tensor([0.5, 0.5, 0.2, 0.9]), torch.tensor([1, 0, 0, 1])) == pytest.approx(0.875)
    assert auroc(torch.ones(6), torch.tensor([1, 0, 1, 0, 0, 1])) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="outcomes: all positive"):
        auroc(torch.rand(3), torch.ones(3))


def test_survival_and_truncate_hand_cases():
    ones = torch.ones(3)
    logits = torch.logit(torch.tensor([0.9, 0.8, 0.5], dtype=torch.float64))
    assert survival(logits, ones).tolist() == pytest.approx([0.9, 0.72, 0.36])
    assert truncate(logits, ones, 0.5) == 2
    assert truncate(logits, ones, 0.3) == 3
    assert truncate(logits, ones, 0.0) == 3
    assert truncate(logits, ones, 0.95) == 0  # zero drafts: the round is a plain target step
    # A confident later slot cannot repair the product: [0.5, 0.99] survives as [0.5, 0.495].
    assert truncate(torch.logit(torch.tensor([0.5, 0.99])), torch.ones(2), 0.5) == 1
    # Temperatures move the cut: logits [2, 2] give [0.881, 0.776] raw but [0.731, 0.718] with T = [2, 0.5].
    two = torch.tensor([2.0, 2.0])
    assert truncate(two, torch.ones(2), 0.72) == 2
    assert truncate(two, torch.tensor([2.0, 0.5]), 0.72) == 1
    assert survival(two.expand(3, 2), torch.ones(2)).shape == (3, 2)
    cal = Calibration([2.0, 0.5], threshold=0.72)
    assert cal.truncate(two) == 1


def test_errors_name_the_bad_argument():
    with pytest.raises(ValueError, match="records: empty"):
        fit_temperatures([])
    with pytest.raises(ValueError, match=r"records\[1\]\.logits: Q=3 but records\[0\] has Q=4"):
        fit_temperatures([ConfidenceRecord(torch.zeros(4), 1), ConfidenceRecord(torch.zeros(3), 1)])
    with pytest.raises(ValueError, match="ConfidenceRecord.accepted"):
        ConfidenceRecord(torch.zeros(4), 5)
    with pytest.raises(ValueError, match="ConfidenceRecord.logits"):
        ConfidenceRecord(torch.zeros(2, 2), 0)
    with pytest.raises(ValueError, match="temperatures_Q: expected shape \\[3\\]"):
        survival(torch.zeros(3), torch.ones(2))
    with pytest.raises(ValueError, match="temperatures_Q: must be finite and > 0"):
        truncate(torch.zeros(2), torch.tensor([1.0, 0.0]), 0.5)
    with pytest.raises(ValueError, match="threshold"):
        truncate(torch.zeros(2), torch.ones(2), 1.5)
    with pytest.raises(ValueError, match="outcomes: 2 values but probs has 3"):
        ece(torch.rand(3), torch.ones(2))
    with pytest.raises(ValueError, match="grid"):
        fit_temperatures([ConfidenceRecord(torch.zeros(2), 1)], grid=[1.0, -1.0])
    with pytest.raises(ValueError, match="no round observed slot 1"):
        fit_temperatures([ConfidenceRecord(torch.zeros(2), 1, 1)])


def test_json_round_trip_and_bad_files(tmp_path, miscalibrated):
    cal = calibrate(to_records(*(t[:2000] for t in miscalibrated)), threshold=0.4, sampling={"temperature": 1.0})
    text = cal.to_json()
    assert json.loads(text)["method"] == "sequential_temperature_scaling"
    assert Calibration.from_json(text) == cal
    save_calibration(cal, str(tmp_path))
    assert load_calibration(str(tmp_path)) == cal
    with pytest.raises(FileNotFoundError, match="calibration.json"):
        load_calibration(str(tmp_path / "missing"))
    good = json.loads(text)
    for bad, match in [
        ({k: v for k, v in good.items() if k != "temperatures"}, "calibration.temperatures: missing"),
        ({**good, "temperatures": [1.0, -2.0]}, "Calibration.temperatures"),
        ({**good, "temperatures": []}, "Calibration.temperatures: empty"),
        ({**good, "threshold": 2}, "Calibration.threshold"),
        ({**good, "extra": 1}, r"unknown fields \['extra'\]"),
        ({**good, "schema_version": 9}, "schema_version"),
    ]:
        with pytest.raises(ValueError, match=match):
            Calibration.from_json(json.dumps(bad))
    with pytest.raises(ValueError, match="not valid JSON"):
        Calibration.from_json("{")


def test_config_carriers():
    cal = Calibration([1.5, 0.9, 1.2], threshold=0.6, ece_before=0.03, ece_after=0.01, n_records=10)
    config = {"block_size": 3, **calibration_config(cal), "draftsmith": {"calibration": cal.to_dict()}}
    assert config[CONFIG_FIELD] == [1.5, 0.9, 1.2]
    assert read_calibration(json.loads(json.dumps(config))) == cal
    assert speculative_config_fields(cal) == {"dspark_confidence_threshold": 0.6}
    foreign = read_calibration({CONFIG_FIELD: [1.5, 0.9, 1.2]})
    assert foreign is not None
    assert foreign.temperatures == [1.5, 0.9, 1.2] and foreign.threshold == 0.5 and foreign.ece_after is None
    assert read_calibration({"block_size": 3}) is None
    with pytest.raises(ValueError, match=CONFIG_FIELD):
        read_calibration({**config, CONFIG_FIELD: [1.0, 1.0, 1.0]})


def test_confidence_metrics_shape(miscalibrated):
    records = to_records(*(t[:3000] for t in miscalibrated))
    raw = confidence_metrics(records)
    assert raw["pairs"] == 3000 * len(FACTORS)
    assert 0.7 < raw["auroc"] < 0.95
    assert sum(row[4] for row in raw["reliability"]) == raw["pairs"]
    json.dumps(raw)  # plain JSON for results.json
    everything_accepted = [ConfidenceRecord(torch.zeros(2), 2)] * 3
    assert confidence_metrics(everything_accepted)["auroc"] is None
