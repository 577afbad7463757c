"""Tests that need an extra venv run once it is built and skip, naming the make target, when it is not."""

import pytest

from tests.support import venvs

pytestmark = pytest.mark.unit


@pytest.fixture
def fake_venv(tmp_path, monkeypatch):
    """`.venv-vllm` moved under tmp_path, nothing built yet."""
    monkeypatch.setitem(venvs.VENVS, "vllm", tmp_path / ".venv-vllm")
    (tmp_path / ".venv-vllm").mkdir()
    return tmp_path / ".venv-vllm"


def test_without_a_build_the_test_is_skipped_naming_the_make_target(fake_venv):
    why = venvs.missing("vllm")
    assert why is not None and why.startswith("no vllm environment") and "make .venv-vllm/.installed" in why
    with pytest.raises(pytest.skip.Exception, match="make .venv-vllm/.installed"):
        venvs.require("vllm")


def test_a_built_venv_runs_and_an_unknown_one_is_refused(fake_venv):
    (fake_venv / ".installed").touch()
    assert venvs.missing("vllm") is None
    venvs.require("vllm")
    with pytest.raises(ValueError, match="unknown venv 'sglang'"):
        venvs.missing("sglang")
