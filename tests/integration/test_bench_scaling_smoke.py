"""`benchmarks.scaling` (and `benchmarks.ablation` on its data) end to end at toy sizes on the tiny target:
a chain and a block drafter (EAGLE-3 and DSpark), three nested data sizes.

The benchmark runs as a user runs it (`python -m benchmarks.scaling` from the repository root) with the tiny
recipe's drafter section swapped per family; DFlash2 takes the same path (its stages are covered by
`test_drafter_families.py`) and is left out to keep the test short. The checks are structural: every
(size, family) row is there, the supervised-token counts grow with the nested subsets and are shared by the
families, the expected accepted tokens per round agree with the measured acc_len, greedy outputs equal plain
decoding, the fits and crossings cover every family and pair, the PNG has the plot's pixel size, and a rerun
reuses every stage.
"""

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import pytest
import yaml

from benchmarks.helpers import scaling_fit as fit

# Six torchrun launches and six evaluations; the bounds leave room for a busy shared machine.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "deployments" / "recipes" / "tiny-cpu.yaml"
BLOCK = {
    "num_layers": 1,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 16,
    "intermediate_size": 64,
    "mask_token_id": 16,
    "num_anchors": 4,
    "draft_vocab_size": 512,
    "fc_norm": False,
}
DRAFTERS = {"dspark": BLOCK | {"kind": "dspark", "block_size": 4, "markov_rank": 8}}
FAMILIES = ["eagle3", "dspark"]
SIZES = [2, 4, 8]


def _recipes(folder: Path) -> str:
    base = yaml.safe_load(TINY.read_text())
    for kind in ["eagle3", *DRAFTERS]:
        recipe = base | {"name": f"tiny-{kind}", "drafter": DRAFTERS.get(kind, base["drafter"])}
        (folder / f"tiny-{kind}.yaml").write_text(yaml.safe_dump(recipe))
    return str(folder / "tiny-{kind}.yaml")


def _run(tmp_path: Path, template: str, timeout: int) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "benchmarks.scaling", "--sizes", ",".join(map(str, SIZES)), "--epochs", "1",
        "--recipe-template", template, "--run-root", str(tmp_path / "runs"), "--json", str(tmp_path / "s.json"),
        "--png", str(tmp_path / "s.png"), "--families", ",".join(FAMILIES),
        "--set", "select.num_eval=2", "--set", "evaluate.max_new_tokens=8",
    ]  # fmt: skip
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _manifests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): json.loads(p.read_text())["created_at"] for p in root.rglob("manifest.json")}


@pytest.mark.bench
def test_two_families_three_sizes(tmp_path):
    template = _recipes(tmp_path)
    proc = _run(tmp_path, template, 1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads((tmp_path / "s.json").read_text())
    rows = r["rows"]
    assert {(x["family"], x["prompts"]) for x in rows} == {(f, n) for f in FAMILIES for n in SIZES}

    # Nested subsets: one token count per size, the same for every family, growing with the size.
    tokens = {n: {x["supervised_tokens"] for x in rows if x["prompts"] == n} for n in SIZES}
    assert all(len(t) == 1 for t in tokens.values()), tokens
    counts = [next(iter(tokens[n])) for n in SIZES]
    assert 0 < counts[0] < counts[1] < counts[2]
    assert r["summary"]["supervised_tokens"] == counts

    for x in rows:
        assert x["samples"] == x["prompts"] and x["eval_prompts"] == 2 and x["mismatched_outputs"] == 0
        assert 1.0 <= x["acc_len"] <= 1 + x["drafts_per_round"]
        assert 0.0 <= x["expected_accepted_first_3"] <= x["expected_accepted"] <= x["drafts_per_round"]
        assert x["expected_accepted"] == pytest.approx(fit.expected_accepted(x["position_accept"]), abs=1e-3)
        assert x["train_seconds"] > 0 and x["steps"] >= 1 and 1 <= x["warmup_steps"] <= x["steps"]
    assert [x["drafts_per_round"] for x in rows if x["prompts"] == 2] == [3, 4]

    summary = r["summary"]
    assert set(summary["acc_len"]["fits"]) == set(FAMILIES)
    (pair,) = summary["acc_len"]["crossings"]
    assert pair["pair"] == FAMILIES and pair["ahead_at_largest"] in [*FAMILIES, None]
    png = (tmp_path / "s.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert (width, height) == (round(fit.INCHES[0] * fit.DPI), round(fit.INCHES[1] * fit.DPI))
    assert "per doubling" in proc.stdout

    # A rerun finds every stage up to date (no manifest rewritten) and reports the same figures.
    before = _manifests(tmp_path / "runs")
    again = _run(tmp_path, template, 280)
    assert again.returncode == 0, again.stderr[-3000:]
    assert _manifests(tmp_path / "runs") == before
    # corpus (select, regenerate); per size: subset, tokenize, shared store, and train + evaluate per family
    assert len(before) >= 2 + len(SIZES) * (3 + 2 * len(FAMILIES))
    assert json.loads((tmp_path / "s.json").read_text())["rows"] == rows

    _ablation_on_the_same_data(tmp_path, template, before)


def _ablation_on_the_same_data(tmp_path: Path, template: str, before: dict[str, str]) -> None:
    """`benchmarks.ablation` on one of those sizes: it reads the scaling run's data and DSpark training
    (copied, not trained again), trains only the new variant, and reports the raw confidence head's ECE."""
    cmd = [
        sys.executable, "-m", "benchmarks.ablation", "--family", "dspark", "--only", "reference,earlier",
        "--size", "4", "--scaling-sizes", ",".join(map(str, SIZES)), "--epochs", "1", "--recipe-template", template,
        "--run-root", str(tmp_path / "runs"), "--json", str(tmp_path / "a.json"),
        "--set", "select.num_eval=2", "--set", "evaluate.max_new_tokens=8",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {x["variant"]: x for x in json.loads((tmp_path / "a.json").read_text())["rows"]}
    assert list(rows) == ["reference", "earlier"]
    assert rows["earlier"]["overrides"] == {
        "drafter.partial_blocks": False, "drafter.target_vocab": "draft", "drafter.init_std": None
    }  # fmt: skip
    for x in rows.values():
        assert x["mismatched_outputs"] == 0 and 1.0 <= x["acc_len"] <= 5.0
        # No calibration pass by default: the raw head's ECE (the evaluation's `confidence_raw`), none after.
        assert 0.0 <= x["ece_before"] <= 1.0 and x["ece_after"] is None
    after = _manifests(tmp_path / "runs")
    assert {k: v for k, v in after.items() if k in before} == before  # no upstream stage computed again
    new = sorted(k for k in after if k not in before)
    assert new == [
        "n4/dspark-earlier/evaluate/manifest.json", "n4/dspark-earlier/train/manifest.json",
        "n4/dspark-reference/evaluate/manifest.json", "n4/dspark-reference/train/manifest.json",
    ]  # fmt: skip
    # The reference's training is the scaling run's, byte for byte (its manifest was copied and accepted).
    assert after["n4/dspark-reference/train/manifest.json"] == before["n4/dspark/train/manifest.json"]
    assert rows["reference"]["overrides"] == {} and "earlier" in proc.stdout


def test_expected_accepted_and_fits():
    assert fit.expected_accepted([0.5, 0.5, 0.5]) == pytest.approx(0.875)
    assert fit.expected_accepted([0.5, 0.5, 0.5], depth=1) == pytest.approx(0.5)
    line = fit.fit_line([1000, 2000, 4000], [1.2, 1.3, 1.4])
    assert line["per_doubling"] == pytest.approx(0.1) and line["rms_residual"] == pytest.approx(0.0, abs=1e-9)
    fits = {"a": fit.fit_line([1, 4], [1.0, 1.2]), "b": fit.fit_line([1, 4], [1.1, 1.15])}
    (c,) = fit.crossings([1, 4], {"a": [1.0, 1.2], "b": [1.1, 1.15]}, fits)
    assert c["measured_between"] == [[1, 4]] and c["ahead_at_largest"] == "a"
    (tie,) = fit.crossings([1, 2, 4], {"a": [1.0, 1.0, 1.2], "b": [1.0, 1.1, 1.1]}, fits)
    assert tie["measured_between"] == [[2, 4]] and tie["ahead_at_largest"] == "a"
    assert c["fitted_meet_tokens"] == 3  # 1.0 + 0.1·log2 x = 1.1 + 0.025·log2 x at log2 x = 4/3: x = 2.52


def test_step_budget_sets_each_sizes_epochs():
    from types import SimpleNamespace

    from benchmarks import scaling

    # Stand-ins holding only what epochs_for reads of a recipe and a tokenize manifest.
    c: Any = SimpleNamespace(train=SimpleNamespace(epochs=8, batch_tokens=1024, grad_accum=1))
    small, large = (cast(Any, SimpleNamespace(counts={"tokens": t})) for t in (4096, 102400))
    assert scaling.epochs_for(c, small, 100) == 25  # 4 batches an epoch
    assert scaling.epochs_for(c, large, 100) == 1  # 100 batches an epoch
    assert scaling.epochs_for(c, cast(Any, SimpleNamespace(counts={"tokens": 10**7})), 100) == 1  # never 0
    assert scaling.epochs_for(c, small, None) == 8  # --epochs given: the recipe's (overridden) epochs
