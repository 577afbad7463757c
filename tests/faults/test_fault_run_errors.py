"""A stage that fails ends `draftsmith run` with one line, `error: <stage>: <reason>`, and no traceback
unless `--debug` or `DRAFTSMITH_DEBUG=1` asks for it."""

import io
import json
import logging
import os

import pytest

import draftsmith.flows.pipeline
from draftsmith import cli
from draftsmith.core.rejects import RejectedShareError
from draftsmith.tasks.select_prompts import select_prompts
from tests.support.paths import RECIPES


@pytest.fixture(autouse=True)
def _own_environ(monkeypatch):
    # cli.main sets its environment defaults (PREFECT_HOME, ...) in this process: keep them from other tests.
    monkeypatch.setattr(os, "environ", os.environ.copy())


def _bad_rows_recipe(tmp_path) -> str:
    """The tiny recipe on a prompt file whose rows are a third malformed: above the 1% rejected share."""
    prompts = tmp_path / "prompts.jsonl"
    good = [json.dumps({"prompt": f"Question {i}: what is {i} times {i + 7}?"}) for i in range(20)]
    prompts.write_text("\n".join(good + ["{not json"] * 10) + "\n")
    text = (RECIPES / "tiny-cpu.yaml").read_text()
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text.replace("  source: synthetic\n", f"  source: jsonl\n  path: {prompts}\n"))
    return str(recipe)


@pytest.fixture
def flow_without_server(monkeypatch):
    """`kimi_k3`'s own body, without Prefect's engine (and server), on the select stage's function."""

    def here(config, stage, run_dir, inputs):
        assert stage == "select_prompts", "only the failing first stage runs"
        return select_prompts(config.select, config.target, seed=config.seed, out_uri=f"{run_dir}/{stage}")

    monkeypatch.setattr(draftsmith.flows.pipeline, "run_here", here)
    monkeypatch.setattr(draftsmith.flows.pipeline, "kimi_k3", draftsmith.flows.pipeline.kimi_k3.fn)
    monkeypatch.delenv("DRAFTSMITH_DEBUG", raising=False)


@pytest.mark.integration
def test_rejected_share_ends_the_run_with_one_line_and_exit_2(flow_without_server, tmp_path, capsys):
    code = cli.main(["run", _bad_rows_recipe(tmp_path), "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2, err
    assert len(errors) == 1 and errors[0].startswith("error: select_prompts: 10 of 30 rows rejected"), err
    assert "select_prompts: select_prompts" not in errors[0]
    assert "Traceback" not in err


@pytest.mark.integration
def test_debug_shows_the_exception(flow_without_server, tmp_path):
    with pytest.raises(RejectedShareError):
        cli.main(["run", _bad_rows_recipe(tmp_path), "--run-dir", str(tmp_path / "run"), "--debug"])


@pytest.mark.unit
@pytest.mark.parametrize("debug", [False, True])
def test_console_log_tracebacks_only_with_debug(monkeypatch, tmp_path, debug):
    """Prefect logs a failed flow run's traceback itself; the console keeps it only under DRAFTSMITH_DEBUG."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    monkeypatch.setattr(logging.getLogger(), "handlers", [handler])
    monkeypatch.setattr(cli, "COMMANDS", {**cli.COMMANDS, "validate": lambda args: 0})
    monkeypatch.setenv("DRAFTSMITH_DEBUG", "1" if debug else "0")
    assert cli.main(["validate", str(tmp_path / "r.yaml")]) == 0
    try:
        raise RuntimeError("stage failed")
    except RuntimeError:
        logging.getLogger("draftsmith.faults").error("Encountered exception during execution", exc_info=True)
    assert "Encountered exception during execution" in out.getvalue()
    assert ("Traceback" in out.getvalue()) is debug
