"""Installing draftsmith adds one top-level import name, `draftsmith`: the wheel built from a copy of the
sources holds every module of every floor under it and nothing else at its top."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from draftsmith.core import layout

pytestmark = [pytest.mark.unit, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_installs_one_top_level_name_with_every_module(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in layout.PACKAGES.values():
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), "."],
        cwd=src, check=True, capture_output=True, timeout=240,
    )  # fmt: skip
    [wheel] = tmp_path.glob("draftsmith-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"draftsmith"}, top
    want = {
        f"draftsmith/{package.removeprefix('draftsmith').strip('.').replace('.', '/')}/{p.relative_to(ROOT / folder)}"
        .replace("//", "/")
        for package, folder in layout.PACKAGES.items()
        for p in (ROOT / folder).rglob("*.py")
        if "__pycache__" not in p.parts
    }  # fmt: skip
    assert want - set(names) == set(), sorted(want - set(names))[:10]
    dist_info = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
    assert zipfile.ZipFile(wheel).read(dist_info).decode().split() == ["draftsmith"]


def test_a_foreign_interpreter_in_the_checkout_imports_kernels_as_an_empty_module():
    """transformers imports a top-level `kernels` to probe for the Hugging Face package; in a venv without
    draftsmith (vLLM's, speculators') started in the checkout, that finds our folder and must not fail."""
    probe = "import sys; sys.path.insert(0, '.'); import kernels; print(sorted(vars(kernels).keys() & {'head_loss'}))"
    out = subprocess.run([sys.executable, "-S", "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr
