"""Installing draftsmith adds one top-level import name, `draftsmith`: the wheel built from a copy of the
sources holds every module of every floor under it and nothing else at its top."""

import os
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
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    # The links as links (draftsmith/core -> ../core, src/draftsmith -> ../draftsmith), as a clone has them.
    for folder in ["src", *layout.PACKAGES.values()]:
        shutil.copytree(ROOT / folder, src / folder, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
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


def test_each_floor_is_a_link_under_draftsmith_and_src_exposes_only_draftsmith():
    """What lets static tools (mypy, pyright, jedi) and the editable install follow `draftsmith.core` to `core/`:
    `draftsmith/core` is a relative link to `../core` (each floor of `core/layout.py` alike), and the install's
    path entry, `src/`, holds one link, to `draftsmith/`."""
    for package, folder in layout.PACKAGES.items():
        if package != "draftsmith":
            link = ROOT / "draftsmith" / package.removeprefix("draftsmith.")
            assert link.is_symlink() and os.readlink(link) == f"../{folder}", link
    # (pip's build leaves draftsmith.egg-info there, git-ignored and not an importable name.)
    assert [n for n in os.listdir(ROOT / "src") if not n.endswith(".egg-info")] == ["draftsmith"]
    assert os.readlink(ROOT / "src" / "draftsmith") == "../draftsmith"


def test_the_installed_path_entry_exposes_draftsmith_and_no_floor_as_a_top_level_name(tmp_path):
    probe = (
        "import importlib.util as u, draftsmith.core.storage as s, os; "
        "print(os.path.realpath(s.__file__), [n for n in ('core', 'kernels', 'tasks') if u.find_spec(n)])"
    )
    out = subprocess.run([sys.executable, "-P", "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(ROOT / "core" / "storage.py"), "[]"], out.stdout


def test_a_foreign_interpreter_in_the_checkout_imports_kernels_as_an_empty_module():
    """transformers imports a top-level `kernels` to probe for the Hugging Face package; in a venv without
    draftsmith (vLLM's, speculators') started in the checkout, that finds our folder and must not fail."""
    probe = "import sys; sys.path.insert(0, '.'); import kernels; print(sorted(vars(kernels).keys() & {'head_loss'}))"
    out = subprocess.run([sys.executable, "-S", "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr
