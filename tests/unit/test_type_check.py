"""`make lint`'s type checker (mypy, `[tool.mypy]` in pyproject.toml) resolves `draftsmith.*` through the
links under `draftsmith/` as an editor does, and fails on a planted type error, naming its file and line."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.unit, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]


def _mypy(path: Path, cache: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(cache)]
    return subprocess.run([*cmd, str(path)], cwd=ROOT, capture_output=True, text=True, timeout=240)


def test_a_planted_type_error_fails_the_check_and_a_correct_use_passes(tmp_path):
    code = "from draftsmith.core.layout import floor_of\n\nfloor: {} = floor_of('draftsmith.core')\n"
    good, bad = tmp_path / "good.py", tmp_path / "planted.py"
    good.write_text(code.format("int | None"))
    bad.write_text(code.format("str"))
    ok = _mypy(good, tmp_path / "cache")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    failed = _mypy(bad, tmp_path / "cache")
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "planted.py:3: error: Incompatible types in assignment" in failed.stdout, failed.stdout
