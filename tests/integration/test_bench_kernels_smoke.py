"""`benchmarks/gpu_kernels.sh --smoke`: the GPU kernel benchmark's whole path on CPU (interpreter, tiny shapes)."""

import json
import subprocess

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.bench]


def test_gpu_kernels_smoke_runs_every_op_and_checks_parity():
    pytest.importorskip("triton")
    proc = subprocess.run(["bash", "benchmarks/gpu_kernels.sh", "--smoke"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["failed"] == []
    ops = {row["op"]: row for row in report["kernels_benchmark"]}
    assert set(ops) == {"head_eagle3", "head_dspark", "rms_norm", "dyn_conv"}
    for op, row in ops.items():
        assert {"reference", "compiled", "triton"} <= set(row), op
        assert row["parity"] < 1e-4, op
        assert all(row[impl]["ms"] > 0 for impl in ("reference", "compiled", "triton")), op
    assert "| head_eagle3 | triton |" in proc.stdout
