"""`core.procs.python_env`: a Python child started in the checkout does not import the checkout's top-level
folders (draftsmith's subpackages) in place of installed packages of the same name."""

import subprocess
import sys
from pathlib import Path

import pytest

from draftsmith.core import procs

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PROBE = "import importlib.util; s = importlib.util.find_spec('kernels'); print(s.origin if s else None)"


def _kernels_origin(env: dict[str, str] | None) -> str:
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_a_child_in_the_checkout_finds_kernels_outside_it_only_with_the_safe_path():
    plain = {k: v for k, v in procs.python_env().items() if k != "PYTHONSAFEPATH"}
    assert _kernels_origin(plain) == str(ROOT / "kernels" / "__init__.py"), "-c puts the working directory first"
    origin = _kernels_origin(procs.python_env())
    assert not origin.startswith(str(ROOT / "kernels")), origin


def test_the_given_environment_is_kept_and_not_changed():
    env = {"A": "1", "PYTHONSAFEPATH": "0"}
    assert procs.python_env(env) == {"A": "1", "PYTHONSAFEPATH": "1"}
    assert env["PYTHONSAFEPATH"] == "0"
