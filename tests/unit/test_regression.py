"""The nightly regression's judgement (bands, finite and decreasing loss, the summary) and `baseline update`."""

import json
import math
from collections.abc import Sequence
from collections.abc import Set as AbstractSet

import pytest
from pydantic import ValidationError

from draftsmith import cli
from draftsmith.core.config import NightlyConfig, load_recipe
from draftsmith.core.config.nightly import Bands
from draftsmith.tasks import regression
from tests.support.paths import RECIPES

pytestmark = pytest.mark.unit
BANDS = Bands(loss_rel=0.03, acc_len_abs=0.08, curve_windows=6, min_loss_drop=0.05)


def _records(losses: Sequence[float | None], skipped: AbstractSet[int] = frozenset()) -> list[dict]:
    return [{"step": i + 1, "loss": v, "skipped": i + 1 in skipped} for i, v in enumerate(losses)]


def _figures(
    losses: Sequence[float | None], acc_len: float = 1.5, mismatched: int | None = 0, **kw
) -> regression.Figures:
    return regression.Figures(
        **regression.loss_figures(_records(losses, **kw), BANDS.curve_windows),
        acc_len=acc_len,
        mismatched_outputs=mismatched,
    )


def _baseline(fig: regression.Figures, recipe) -> regression.Baseline:
    return regression.make_baseline(recipe, fig, "/runs/x", BANDS)


@pytest.fixture(scope="module")
def eagle3_recipe():
    return load_recipe(RECIPES / "nightly-eagle3.yaml")


DECAY = [10.0 * 0.97**i for i in range(24)]  # 24 steps: four per window


def test_windows_split_steps_evenly_and_refuse_too_few():
    assert regression.window_bounds(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert regression.window_bounds(6, 6) == [(i, i + 1) for i in range(6)]
    with pytest.raises(ValueError, match=r"5 training steps cannot fill 6 loss windows \(bands.curve_windows\)"):
        regression.window_bounds(5, 6)


def test_loss_figures_average_windows_and_count_bad_steps():
    losses = [8.0, 6.0, None, 4.0, 3.0, 3.0, 2.0, 2.0, 1.0, 1.0, 1.0, 0.5]
    fig = regression.loss_figures(_records(losses, skipped={5}), windows=3)
    assert fig["steps"] == 12
    assert fig["bad_steps"] == 2  # step 3's null (non-finite) loss and step 5, skipped
    assert fig["loss_curve"] == [pytest.approx(6.0), pytest.approx(2.5), pytest.approx(0.875)]
    assert fig["windows"] == [(1, 4), (5, 8), (9, 12)]
    assert fig["final_loss"] == 0.5
    assert regression.loss_figures(_records([3.0, 2.0, float("nan")]), 3)["final_loss"] is None


def test_health_checks_pass_a_decreasing_finite_lossless_run():
    checks = regression.health_checks("eagle3", _figures(DECAY), BANDS)
    assert [c.figure for c in checks] == [
        "non-finite or skipped steps",
        "loss drop, first to last window",
        "greedy outputs differing from plain decoding",
    ]
    assert all(c.passed for c in checks)
    assert checks[1].value == pytest.approx(1 - (sum(DECAY[-4:]) / 4) / (sum(DECAY[:4]) / 4))


@pytest.mark.parametrize(
    ("losses", "mismatched", "failing"),
    [
        ([5.0] * 24, 0, "loss drop, first to last window"),  # flat: not decreasing
        ([5.0 + 0.1 * i for i in range(24)], 0, "loss drop, first to last window"),  # rising
        ([*DECAY[:10], None, *DECAY[11:]], 0, "non-finite or skipped steps"),
        (DECAY, 2, "greedy outputs differing from plain decoding"),
    ],
)
def test_health_checks_fail_flat_rising_nonfinite_or_lossy_runs(losses, mismatched, failing):
    checks = regression.health_checks("dspark", _figures(losses, mismatched=mismatched), BANDS)
    assert [c.figure for c in checks if not c.passed] == [failing]


def test_a_run_whose_losses_are_all_nan_fails_instead_of_passing_silently():
    fig = _figures([None] * 24)
    checks = regression.health_checks("eagle3", fig, BANDS)
    assert {c.figure for c in checks if not c.passed} == {
        "non-finite or skipped steps",
        "loss drop, first to last window",
    }


def test_baseline_checks_pass_inside_the_bands_and_fail_outside(eagle3_recipe):
    base = _baseline(_figures(DECAY, acc_len=1.5), eagle3_recipe)
    same = regression.baseline_checks("eagle3", _figures(DECAY, acc_len=1.5), base, BANDS)
    assert len(same) == 1 + 6 + 1 + 1 and all(c.passed for c in same)
    near = regression.baseline_checks("eagle3", _figures([v * 1.02 for v in DECAY], acc_len=1.57), base, BANDS)
    assert all(c.passed for c in near), [c for c in near if not c.passed]
    far = regression.baseline_checks("eagle3", _figures([v * 1.04 for v in DECAY], acc_len=1.59), base, BANDS)
    failed = {c.figure for c in far if not c.passed}
    assert failed == {*(f"loss window {i}/6 (steps {4 * i - 3}-{4 * i})" for i in range(1, 7)), "final loss (step 24)",
                      "acc_len"}  # fmt: skip
    low = regression.baseline_checks("eagle3", _figures([v * 0.96 for v in DECAY], acc_len=1.41), base, BANDS)
    assert sum(not c.passed for c in low) == 8  # bands are two-sided: a sudden improvement is a change too
    longer = regression.baseline_checks("eagle3", _figures([*DECAY, *DECAY[-6:]]), base, BANDS)
    assert [c.figure for c in longer if c.figure == "optimizer steps" and not c.passed] == ["optimizer steps"]


def test_band_edges_and_missing_values():
    check = regression.Check(drafter="d", figure="f", value=1.0, low=1.0, high=2.0)
    assert check.passed and check.model_copy(update={"value": 2.0}).passed
    assert not check.model_copy(update={"value": 2.0001}).passed
    assert not check.model_copy(update={"value": None}).passed
    assert not check.model_copy(update={"value": math.nan}).passed
    assert regression.Check(drafter="d", figure="f", value=7.0, low=0.05).passed


def test_baseline_with_other_window_count_is_a_clear_error(eagle3_recipe):
    base = _baseline(_figures(DECAY), eagle3_recipe)
    fig = regression.Figures(**regression.loss_figures(_records(DECAY), 4), acc_len=1.5, mismatched_outputs=0)
    with pytest.raises(ValueError, match=r"6 loss windows but bands.curve_windows is 4; run `draftsmith baseline"):
        regression.baseline_checks("eagle3", fig, base, BANDS)


def test_summary_lists_every_figure_with_band_value_and_verdict(eagle3_recipe):
    base = _baseline(_figures(DECAY, acc_len=1.5), eagle3_recipe)
    fig = _figures(DECAY, acc_len=1.3)
    checks = regression.health_checks("eagle3", fig, BANDS) + regression.baseline_checks("eagle3", fig, base, BANDS)
    checks.append(regression.pipeline_failed("dspark", "train: loss is NaN"))
    md = regression.summary_markdown(checks, "/runs/night", {"eagle3": "as recorded"})
    assert md.startswith(f"# Nightly regression: FAIL (2 of {len(checks)} figures out of band)\n")
    assert "- **eagle3**: acc_len = 1.3000, acceptance left its band" in md
    assert "- **dspark**: pipeline = —, the run failed: train: loss is NaN" in md
    assert "| eagle3 | acc_len | 1.5000 | 1.4200 .. 1.5800 | 1.3000 | **FAIL** |" in md
    assert "| eagle3 | non-finite or skipped steps | — | = 0 | 0 | PASS |" in md
    assert "| eagle3 | loss drop, first to last window | — | >= 0.0500 |" in md
    rows = [line for line in md.splitlines() if line.startswith("| eagle3 |") or line.startswith("| dspark |")]
    assert len(rows) == len(checks)
    ok = regression.summary_markdown(checks[:-2], "/runs/night", {})
    assert ok.startswith(f"# Nightly regression: PASS (all {len(checks) - 2} figures in band)") and "FAIL" not in ok


def _write_run(run_dir, losses, acc_len=1.25, mismatched=0):
    (run_dir / "train").mkdir(parents=True)
    (run_dir / "evaluate").mkdir()
    (run_dir / "train" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records(losses)))
    results = {"acc_len": {"overall": acc_len, "held-out": acc_len}, "mismatched_outputs": mismatched}
    (run_dir / "evaluate" / "results.json").write_text(json.dumps(results))


def test_read_figures_from_a_run_folder_and_name_what_is_missing(tmp_path):
    _write_run(tmp_path / "run", DECAY, acc_len=1.25)
    fig = regression.read_figures(str(tmp_path / "run"), 6)
    assert (fig.steps, fig.acc_len, fig.mismatched_outputs, fig.final_loss) == (24, 1.25, 0, DECAY[-1])
    (tmp_path / "half" / "train").mkdir(parents=True)
    (tmp_path / "half" / "train" / "metrics.jsonl").write_text("")
    with pytest.raises(FileNotFoundError, match=r"half/evaluate/results.json is missing"):
        regression.read_figures(str(tmp_path / "half"), 6)


def test_an_unhealthy_run_cannot_become_a_baseline(eagle3_recipe):
    with pytest.raises(ValueError, match=r"not healthy \(loss drop, first to last window = 0\); not recorded"):
        regression.make_baseline(eagle3_recipe, _figures([5.0] * 24), "/runs/flat", BANDS)


def test_nightly_config_is_strict_and_points_at_the_committed_files():
    cfg = NightlyConfig()
    for drafter in cfg.drafters:
        assert load_recipe(f"{cfg.recipe_dir}/nightly-{drafter}.yaml").drafter.kind == drafter
        assert regression.load_baseline(cfg.baseline_dir, drafter) is not None, drafter
    with pytest.raises(ValidationError, match="nightly.drafters: each drafter once"):
        NightlyConfig(drafters=["eagle3", "eagle3"])
    with pytest.raises(ValidationError, match="nightly.run_name: 'a/b' must be one folder name"):
        NightlyConfig(run_name="a/b")
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        NightlyConfig.model_validate({"bands": {"loss_rel": 0.1, "bogus": 1}})


def _update(capsys, *args) -> tuple[int, str, str]:
    code = cli.main(["baseline", "update", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_baseline_update_writes_the_files_and_prints_old_to_new(tmp_path, capsys):
    runs, baselines = tmp_path / "runs", tmp_path / "baselines"
    _write_run(runs / "nightly-eagle3", DECAY, acc_len=1.25)
    code, out, _ = _update(capsys, "--from", str(runs), "--baseline-dir", str(baselines), "--drafter", "eagle3")
    assert code == 0
    written = json.loads((baselines / "nightly-eagle3.json").read_text())
    assert written["steps"] == 24 and written["acc_len"] == 1.25 and len(written["loss_curve"]) == 6
    assert written["recipe_sha256"] == regression.recipe_sha256(load_recipe(RECIPES / "nightly-eagle3.yaml"))
    assert "acc_len: 1.2500 (new)" in out and "steps: 24 (new)" in out

    _write_run(tmp_path / "later" / "nightly-eagle3", [v * 1.1 for v in DECAY], acc_len=1.5)
    code, out, _ = _update(capsys, "--from", str(tmp_path / "later"), "--baseline-dir", str(baselines),
                           "--drafter", "eagle3")  # fmt: skip
    assert code == 0
    assert "acc_len: 1.2500 -> 1.5000 (+0.2500, +20.00%)" in out
    assert f"final loss: {DECAY[-1]:.4f} -> {DECAY[-1] * 1.1:.4f}" in out
    assert "steps: 24 (unchanged)" in out
    assert json.loads((baselines / "nightly-eagle3.json").read_text())["acc_len"] == 1.5


def test_baseline_update_refuses_unhealthy_runs_and_overrides(tmp_path, capsys):
    runs, baselines = tmp_path / "runs", tmp_path / "baselines"
    _write_run(runs / "nightly-dspark", [*DECAY[:5], None, *DECAY[6:]])
    code, _, err = _update(capsys, "--from", str(runs), "--baseline-dir", str(baselines), "--drafter", "dspark")
    assert code == 1 and "non-finite or skipped steps = 1" in err and "no baseline was changed" in err
    assert not baselines.exists()
    code, _, err = _update(capsys, "--from", str(runs), "--drafter", "eagle3", "--baseline-dir", str(baselines))
    assert code == 1 and "nightly-eagle3/train/metrics.jsonl is missing" in err
    config = tmp_path / "nightly.yaml"
    config.write_text("overrides: {train.lr: 0.3}\n")
    code, _, err = _update(capsys, "--config", str(config), "--from", str(runs))
    assert code == 2 and "overrides: {'train.lr': 0.3} would record figures" in err


def test_the_summary_note_says_whether_the_recipe_is_the_recorded_one(tmp_path, eagle3_recipe):
    base = _baseline(_figures(DECAY), eagle3_recipe)
    (tmp_path / "nightly-eagle3.json").write_text(base.model_dump_json())
    assert regression.recipe_note(eagle3_recipe, str(tmp_path), {}).startswith("`nightly-eagle3` as recorded ")
    hot = regression.nightly_recipe(NightlyConfig(overrides={"train.lr": 0.3}), "eagle3")
    assert hot.train.lr == 0.3
    note = regression.recipe_note(hot, str(tmp_path), {"train.lr": 0.3})
    assert "differs from the recipe recorded" in note and note.endswith("(overrides: train.lr=0.3)")
    assert regression.recipe_note(eagle3_recipe, str(tmp_path / "none"), {}) == "`nightly-eagle3`, no baseline recorded"


def test_prune_nights_keeps_the_newest_timestamped_folders(tmp_path) -> None:
    nights = ["20261127T020000Z", "20261128T020000Z", "20261129T020001Z", "20261130T020000Z"]
    for name in [*nights, "night", "20261101-old"]:
        (tmp_path / name / "nightly-eagle3").mkdir(parents=True)
    assert regression.prune_nights(str(tmp_path), 0) == []
    deleted = regression.prune_nights(str(tmp_path), 2)
    assert deleted == [str(tmp_path / n) for n in nights[:2]]
    # Named runs and foreign folders stay; a second prune has nothing left to do.
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*nights[2:], "night", "20261101-old"])
    assert regression.prune_nights(str(tmp_path), 2) == []
    assert regression.prune_nights(str(tmp_path / "absent"), 2) == []
    with pytest.raises(ValidationError, match="keep_nights"):
        NightlyConfig(keep_nights=-1)
