"""Where the tests find the checkout's files."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "deployments" / "recipes"
TINY = RECIPES / "tiny-cpu.yaml"  # the tiny recipe every end-to-end test runs
