"""`benchmarks.train` end to end at toy sizes on the tiny recipe: every part runs and its figures are sane.

The benchmark runs as `make bench` runs it (`python -m benchmarks.train` from the repository root) and
writes its figures as JSON. Timings are not compared against thresholds (CI machines are shared); the
properties are structural: length grouping pads less than random batching, both step variants train, both
rank counts report throughput over the same padded tokens, and the peaks are measured.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.bench, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "deployments" / "recipes" / "tiny-cpu.yaml"


def test_every_part_runs_at_toy_sizes(tmp_path):
    out = tmp_path / "figures.json"
    cmd = [sys.executable, "-m", "benchmarks.train", "--quick", "--recipe", str(TINY), "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert "tokens/s 2 ranks / 1 rank" in proc.stdout and "== summary" in proc.stdout

    shares = r["shares"]
    assert set(shares) == {"random", "grouped chunk 2048", "grouped chunk 512"}
    assert all(0.0 <= s < 1.0 for s in shares.values()), shares
    assert shares["grouped chunk 2048"] < shares["random"] and shares["grouped chunk 512"] < shares["random"]

    s = r["sync"]
    assert s["ours_tokens_per_s"] > 0 and s["synced_tokens_per_s"] > 0 and s["ratio"] > 0
    assert s["fused_opt_s"] > 0 and s["foreach_opt_s"] > 0 and s["tokens_per_step"] > 0

    one, two = r["ranks"]
    assert (one["ranks"], one["grad_accum"], two["ranks"], two["grad_accum"]) == (1, 2, 2, 1)
    assert one["steps"] == two["steps"] == 3
    # The same micro-batches per step whatever the rank count: equal padded tokens trained.
    assert one["padded_tokens"] == two["padded_tokens"] > 0
    assert one["tokens_per_s"] > 0 and two["tokens_per_s"] > 0
    assert one["mfu"] > 0 and two["mfu"] > 0
    assert r["peaks"]["fp32"] > 0 and r["peaks"]["bf16"] > 0
