"""The temporary Prefect server gets a generous start-up timeout, and a start that still times out ends
`draftsmith run` with one line naming the way around it."""

import os
import subprocess
import sys

import pytest

from draftsmith import cli
from tests.support.paths import RECIPES

SETTING = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"


@pytest.mark.unit
def test_the_cli_raises_prefects_start_up_timeout_unless_set(monkeypatch):
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k != SETTING})
    cli._env_defaults()
    assert int(os.environ[SETTING]) >= 120
    monkeypatch.setenv(SETTING, "7")
    cli._env_defaults()
    assert os.environ[SETTING] == "7"


@pytest.mark.integration
def test_a_server_that_does_not_start_in_time_is_one_line(tmp_path):
    # A timeout of 0 s fails the way a loaded machine does, without waiting for it.
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env |= {SETTING: "0", "PREFECT_HOME": str(tmp_path / "prefect"), "DRAFTSMITH_DEBUG": "0"}
    proc = subprocess.run(
        [sys.executable, "-m", "draftsmith.cli", "run", str(RECIPES / "tiny-cpu.yaml"), "--run-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 1, proc.stderr
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "temporary Prefect server" in errors[0] and "prefect server start" in errors[0]
    assert "PREFECT_API_URL=http://127.0.0.1:4200/api" in errors[0]
