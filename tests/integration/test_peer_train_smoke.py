"""`benchmarks.peer_train` end to end at toy sizes: both sides train every family and report figures.

Runs as `python -m benchmarks.peer_train --quick` (the tiny recipe, sequence 64). Timings are not compared
(CI machines are shared); the properties are structural: every family ran on both sides, once per round,
with positive throughput and a measured peak RSS.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.bench, pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
PEER_PYTHON = ROOT / ".venv-speculators" / "bin" / "python"


@pytest.mark.venv("speculators")
def test_both_sides_train_every_family_at_toy_sizes(tmp_path):
    out = tmp_path / "figures.json"
    cmd = [sys.executable, "-m", "benchmarks.peer_train", "--quick", "--rounds", "2", "--steps", "1"]
    proc = subprocess.run([*cmd, "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=880)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert list(r["families"]) == ["EAGLE-3, TTT 3", "EAGLE-3, TTT 7", "DFlash, block 4", "DSpark, block 4"]
    for name, f in r["families"].items():
        assert f["steps_per_side"] == 2, name  # 2 rounds x 1 timed step, interleaved
        assert f["ours_tokens_per_s"] > 0 and f["peer_tokens_per_s"] > 0, name
        assert f["ratio"] == pytest.approx(f["ours_tokens_per_s"] / f["peer_tokens_per_s"])
        assert 0 < f["ours_peak_rss_gib"] < 64 and 0 < f["peer_peak_rss_gib"] < 64, name
        assert name in proc.stdout
