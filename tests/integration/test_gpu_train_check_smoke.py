"""`benchmarks/gpu_train_check.sh --smoke`: the GPU check's whole logic on CPU (gloo, toy widths).

A GPU machine runs the same script at Kimi K3 sizes; these runs prove, where CI can run them, that every
family builds from its K3 recipe's drafter section through the worker's path (meta skeleton, FSDP2 shard,
rank-0 materialise, fused AdamW `Trainer`), trains finite steps, and that the report and exit status are
right, including when one family fails.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_train_check.sh"

pytestmark = [pytest.mark.integration, pytest.mark.bench]


def _run(*args: str) -> tuple[subprocess.CompletedProcess, dict]:
    env = dict(os.environ, PYTHON=sys.executable, CHECK_TIMEOUT="120")
    env.pop("OUT", None)
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--smoke", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180
    )
    json_lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert json_lines, f"no JSON report; stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    return proc, json.loads(json_lines[-1])


def test_smoke_trains_every_family_through_the_worker_path_and_reports_it():
    proc, report = _run()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report["ok"] is True
    assert {c["check"]: c["ok"] for c in report["checks"]} == {"backend": True, "all_reduce": True, "fsdp2": True}
    assert [(c["family"], c["compiled"], c["status"]) for c in report["cases"]] == [
        ("eagle3", False, "ok"),
        ("dflash2", False, "ok"),
        ("dspark", False, "ok"),
    ]
    for case in report["cases"]:
        name = case["family"]
        assert case["fused"] is True, name
        assert case["params_trainable"] > 0 and case["tokens_per_s"] > 0, name
        # 1 warm-up + 2 timed steps, each read back one step late and checked finite.
        assert len(case["losses"]) == 3 and all(0 < x < 100 for x in case["losses"]), (name, case["losses"])
        assert case["flops_per_step"] > 0 and 0 < case["mfu"] < 1, name
    # The block drafters share the target's frozen lm_head; EAGLE-3 trains a pruned head, so fewer frozen.
    frozen = {c["family"]: c["params_frozen"] for c in report["cases"]}
    assert frozen["dflash2"] == frozen["dspark"] > frozen["eagle3"] > 0
    assert "| family | mode | status |" in proc.stdout


def test_one_failing_family_fails_the_run_but_the_others_still_run():
    proc, report = _run("--families", "eagle3,dspark", "--inject-failure", "eagle3", "--warmup", "0", "--steps", "1")
    assert proc.returncode == 1
    assert report["ok"] is False
    cases = {c["family"]: c for c in report["cases"]}
    assert cases["eagle3"]["status"] == "FAIL" and "injected failure" in cases["eagle3"]["error"]
    assert cases["dspark"]["status"] == "ok" and cases["dspark"]["tokens_per_s"] > 0
    assert "| eagle3 | eager | FAIL |" in proc.stdout
