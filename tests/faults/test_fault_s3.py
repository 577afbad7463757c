"""An S3 run folder under faults, on a real SeaweedFS server (`tests/support/s3.py`) on loopback.

The server SIGKILLed while a stage writes its shards: the stage fails with one line naming the object, a
transient error its retry policy retries; nothing half-written is committed and no manifest appears; after a
restart the rerun resumes and stores exactly what a fault-free run stores. Credentials that may only read:
the first write and a delete are refused at once, in one line naming the object and the bucket, without
retries or secrets; `draftsmith run` into such a bucket ends with one `error:` line and exit 2.
"""

import os
import time

import pytest

import draftsmith.flows.pipeline
from draftsmith import cli
from draftsmith.core.storage import StorageRefused, StorageUnavailable
from tests.support.faults.storage import READ_ONLY, read_only_bucket, s3_env, s3_restart
from tests.support.paths import RECIPES
from tests.support.s3 import WeedServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def _one_line(text: str) -> str:
    assert text and "\n" not in text, repr(text)
    return text


def test_a_server_killed_mid_write_fails_in_one_line_and_the_rerun_loses_nothing(tmp_path):
    r = s3_restart(tmp_path)
    d = r.detail
    assert isinstance(d["error"], StorageUnavailable), repr(d["error"])
    line = _one_line(str(d["error"]))
    # The object named is the one being written when the server died: shard 1, its commit or shard 2.
    assert line.startswith("s3://draftsmith/run/hidden_states/") and ": write failed, " in line, line
    assert "did not answer" in line
    assert d["transient"], "a server that comes back is worth the stage's retry"
    # Seen after the restart, before the rerun: whole shards behind their commits, no manifest.
    assert (d["manifest"], d["bad_commits"], d["torn"]) == (0, 0, 0), d
    assert 1 <= d["committed"] < d["shards"], d
    assert (r.lost, r.duplicated, r.corrupted) == (0, 0, 0), r
    assert not d["files_differ"], "the rerun's manifest lists other bytes than the clean run's"
    assert r.detected_within_s < 60, r


def test_read_only_credentials_are_refused_at_the_first_write_and_at_a_delete(tmp_path):
    r = read_only_bucket(tmp_path)
    d = r.detail
    write, delete = d["write_error"], d["delete_error"]
    assert isinstance(write, StorageRefused), repr(write)
    line = _one_line(str(write))
    assert line.startswith("s3://draftsmith/new/hidden_states/.stage-key: write refused by bucket 'draftsmith'"), line
    assert not d["transient"] and r.detected_within_s < 5, "a refusal is final: no retries"
    assert d["written_by_reader"] == []
    # s3fs drops the errors of a bulk delete; the refusal must surface, naming an object it kept.
    assert isinstance(delete, StorageRefused), repr(delete)
    line = _one_line(str(delete))
    assert line.startswith("s3://draftsmith/done/hidden_states/") and "delete refused" in line, line
    for secret in d["secrets"]:
        assert secret not in str(write) and secret not in str(delete)
    assert (r.lost, r.duplicated, r.corrupted) == (0, 0, 0), r


def test_draftsmith_run_into_a_read_only_bucket_ends_with_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    # cli.main sets its environment defaults in this process: keep them from other tests.
    monkeypatch.setattr(os, "environ", os.environ.copy())
    monkeypatch.delenv("DRAFTSMITH_DEBUG", raising=False)
    monkeypatch.setattr(
        draftsmith.flows.pipeline, "kimi_k3", draftsmith.flows.pipeline.kimi_k3.fn
    )  # the flow's body, no server
    run_dir = "s3://draftsmith/runs/tiny-cpu"
    with WeedServer(tmp_path / "weed", identities=[READ_ONLY]) as weed:
        reader = {"AWS_ACCESS_KEY_ID": READ_ONLY["key"], "AWS_SECRET_ACCESS_KEY": READ_ONLY["secret"]}
        with s3_env(weed.env | reader):
            start = time.monotonic()
            code = cli.main(["run", str(RECIPES / "tiny-cpu.yaml"), "--run-dir", run_dir])
            took = time.monotonic() - start
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2, err
    assert len(errors) == 1, err
    # The run's first write (its lease or its recipe.yaml) is the one refused.
    assert f"{run_dir}/" in errors[0] and ": write refused by bucket 'draftsmith'" in errors[0], errors[0]
    assert "Traceback" not in err
    assert READ_ONLY["key"] not in err and READ_ONLY["secret"] not in err
    assert took < 30, f"{took:.1f} s: a refusal must not be retried"
