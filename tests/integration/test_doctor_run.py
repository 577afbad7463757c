"""`draftsmith doctor` on a real tiny run: every check finds the facts it reads in what the stages wrote (no
"not checked"), the run's own template and taps agree, and a tap off-by-one planted in a copy is named."""

import json
import shutil

import pytest

from draftsmith import cli

pytestmark = pytest.mark.integration


def _doctor(run, capsys) -> list[dict]:
    assert cli.main(["doctor", str(run), "--json"]) == 0
    return json.loads(capsys.readouterr().out)["findings"]


def test_doctor_reads_every_fact_of_a_tiny_run(tiny_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(tiny_run["run_dir"], run)
    found = _doctor(run, capsys)
    unread = [f for f in found if f["title"].startswith("not checked")]
    assert unread == []
    by_check = {f["check"]: f for f in found}
    assert set(by_check) >= {"long-context", "free-speculation", "draft-vocabulary", "generalisation-gap"}
    # Regenerate, tokenize and the evaluation all rendered with the tiny target's own template, in one mode.
    template = [f for f in found if f["check"] == "template"]
    mismatch = [
        f["title"] for f in template if f["severity"] != "ok" and ("template" in f["title"] or "thinking" in f["title"])
    ]
    assert template and mismatch == [], template
    assert [f["severity"] for f in found if f["check"] == "tap-convention"] == ["ok"]
    rows = [json.loads(line) for line in (run / "evaluate" / "prompts.jsonl").read_text().splitlines()]
    # The facts the evaluation records for the doctor agree with its own counts, row by row.
    for r in rows:
        assert len(r["round_accepts"]) == r["rounds"] and sum(r["round_accepts"]) == r["accepted"], r["id"]
        assert r["prompt_tokens"] == len(r["prompt_ids"]) > 0, r["id"]
    outputs = sum(len(r["output_ids"]) for r in rows)
    assert f"of {outputs} target tokens" in " ".join(by_check["draft-vocabulary"]["evidence"])

    config_path = run / "train" / "config.json"
    config = json.loads(config_path.read_text())
    shifted = [t - 1 for t in config["draftsmith"]["taps"]]
    config["eagle_aux_hidden_state_layer_ids"] = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = shifted
    config_path.write_text(json.dumps(config))
    taps = [f for f in _doctor(run, capsys) if f["check"] == "tap-convention"]
    assert [f["severity"] for f in taps] == ["error"] and "off by -1 layer" in taps[0]["title"]
