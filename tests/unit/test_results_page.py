"""The results page every pipeline run publishes: built from the run folder alone, each figure labelled with what
it measures, a speed-up shown only for the checkpoint it was measured on, and never failing a run."""

import json
from pathlib import Path

import pytest

from draftsmith.evals import results_page
from draftsmith.evals.doctor.facts import read_run
from draftsmith.evals.doctor.report import diagnose_facts
from tests.support.doctor_runs import Plan, healthy_run

pytestmark = pytest.mark.unit


def _level(c: int, server: str, method: str, depth: int | None, speedup: float) -> dict:
    return {"concurrency": c, "server": server, "method": method, "draft_tokens": depth, "speedup": speedup,
            "tokens_per_s_off": [10.0], "tokens_per_s_on": [10.0 * speedup], "spec_decode": None,
            "outputs_differing": 0, "outputs_compared": 8}  # fmt: skip


def _speedup(run: Path, train_key: str) -> None:
    levels = [_level(1, "drafter-3", "drafter", 3, 1.25), _level(1, "ngram", "ngram", None, 1.10)]
    (run / "speedup").mkdir(exist_ok=True)
    (run / "speedup" / "speedup.json").write_text(json.dumps({"train_key": train_key, "levels": levels}))


def test_page_labels_each_figure_and_carries_the_doctor(tmp_path):
    run = healthy_run(tmp_path / "run", Plan(layer_ids=[0, 1, 2]))  # a tap off by one: the doctor's error
    _speedup(run, "train-key")
    facts = read_run(str(run))
    page = results_page.results_markdown(facts, diagnose_facts(facts))
    results = json.loads((run / "evaluate" / "results.json").read_text())
    for bench in ("held-out", "math"):
        assert f"{results['acc_len'][bench]:.3f}" in page
    assert f"**{results['acc_len']['overall']:.3f}**" in page
    assert "## Training loss" in page and "### Loss curve" in page and "| steps | 200 |" in page
    assert "| 1 | drafter-3 | 10.0 | 12.5 | ×1.25 |" in page
    assert "the drafter (drafter-3) beats ngram" in page
    assert f"Harness ratio x{results['speedup']:.2f}" in page and "it is not a serving speed-up" in page
    assert "| error | tap-convention |" in page
    assert "![acc_len_by_bench](data:image/png;base64," in page


def test_a_speedup_of_another_checkpoint_is_not_shown_as_this_ones(tmp_path):
    run = healthy_run(tmp_path / "run")
    _speedup(run, "an-earlier-train-key")
    page = results_page.results_markdown(read_run(str(run)), None)
    assert "×1.25" not in page and "Not measured for this checkpoint" in page
    assert "## Doctor" not in page


def test_a_run_without_evaluation_or_speedup_says_what_is_missing(tmp_path):
    run = healthy_run(tmp_path / "run")
    for name in ("results.json", "prompts.jsonl", "manifest.json", "acc_len_by_bench.png"):
        (run / "evaluate" / name).unlink()
    page = results_page.results_markdown(read_run(str(run)), None)
    assert "Not measured: the evaluate stage has no results." in page
    assert f"Not measured: `draftsmith speedup {run}`" in page and "## Plots" not in page


def test_publish_makes_one_artifact_per_run_folder_and_never_fails(tmp_path, monkeypatch):
    from prefect import artifacts

    from draftsmith.evals import report

    run = healthy_run(tmp_path / "my-run")
    assert results_page.publish(str(run)) == []  # outside a flow run: nothing, and no server started
    made: list[dict] = []
    monkeypatch.setattr(report, "in_prefect_run", lambda: True)
    monkeypatch.setattr(artifacts, "create_markdown_artifact", lambda **kw: made.append(kw))
    assert results_page.publish(str(run)) == ["results-my-run"]
    assert made[0]["markdown"].startswith("# Results: my-run") and "## Doctor" in made[0]["markdown"]
    assert results_page.publish(str(run), with_doctor=False) == ["results-my-run"]
    assert "## Doctor" not in made[1]["markdown"]
    (run / "evaluate" / "results.json").write_text("{not json")
    assert results_page.publish(str(run)) == [] and len(made) == 2  # a page that fails fails nothing


def test_a_plot_is_shown_only_while_it_matches_its_record(tmp_path):
    """The evaluate manifest and speedup.json record each plot's size and digest: a damaged, replaced or
    unrecorded plot is left out of the page, and the figures around it stay."""
    from draftsmith.core.manifest import entry

    run = healthy_run(tmp_path / "run")
    _speedup(run, "train-key")
    png = (run / "evaluate" / "acc_len_by_bench.png").read_bytes()
    (run / "speedup" / "speedup.png").write_bytes(png)
    page = results_page.results_markdown(read_run(str(run)), None)
    assert "![speedup]" not in page and "| 1 | drafter-3 | 10.0 | 12.5 | ×1.25 |" in page  # not recorded
    measured = json.loads((run / "speedup" / "speedup.json").read_text())
    measured["files"] = {"speedup.png": entry("speedup.png", png).model_dump(exclude={"name"})}
    (run / "speedup" / "speedup.json").write_text(json.dumps(measured))
    page = results_page.results_markdown(read_run(str(run)), None)
    assert "![speedup](data:image/png;base64," in page and "![acc_len_by_bench](data:image/png;base64," in page

    for bad in ({"bytes": "many"}, ["not", "a", "record"]):
        (run / "speedup" / "speedup.json").write_text(json.dumps(measured | {"files": {"speedup.png": bad}}))
        page = results_page.results_markdown(read_run(str(run)), None)
        assert "![speedup]" not in page and "| 1 | drafter-3 | 10.0 | 12.5 | ×1.25 |" in page
    (run / "speedup" / "speedup.json").write_text(json.dumps(measured))

    damaged = bytearray(png)
    damaged[len(damaged) // 2] ^= 0xFF
    for name in ("evaluate/acc_len_by_bench.png", "speedup/speedup.png"):
        (run / name).write_bytes(bytes(damaged))
    page = results_page.results_markdown(read_run(str(run)), None)
    assert "data:image/png" not in page and "| 1 | drafter-3 | 10.0 | 12.5 | ×1.25 |" in page
    assert f"{json.loads((run / 'evaluate' / 'results.json').read_text())['acc_len']['overall']:.3f}" in page
