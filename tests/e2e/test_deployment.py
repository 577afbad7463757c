"""`kimi-k3/eagle3` for real: a Prefect server on loopback, the `local-cpu` process work pool,
`prefect deploy` of deployments/prefect.yaml, and one flow run of the tiny recipe executed by a
`--run-once` process worker. Every subprocess is the venv's `prefect`, talking to 127.0.0.1 only.
"""

import json
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from draftsmith.config import PipelineConfig
from tests.e2e.prefect_server import PREFECT, ROOT, Server, get_json, stop, tail

PREFECT_FILE = ROOT / "deployments" / "prefect.yaml"
RECIPES = ROOT / "deployments" / "recipes"
WORKER_TIMEOUT_S = 420

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _cli(server: Server, *args: str, timeout: float = 180) -> str:
    """Run `prefect ARGS` from the repository root; fail with its output if it fails."""
    res = subprocess.run(
        [str(PREFECT), *args],
        cwd=ROOT,
        env=server.env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0, f"`prefect {' '.join(args[:3])} ...` exited {res.returncode}:\n{out}"
    return out


def _run_worker(server: Server, log: Path, cwd: Path) -> int:
    """`prefect worker start --run-once`, output to `log`; stopped by PID (two SIGTERMs) however it ends."""
    with log.open("wb") as fh:
        proc = subprocess.Popen(
            [str(PREFECT), "worker", "start", "--pool", "local-cpu", "--type", "process", "--run-once"],
            # Anywhere but the repository: only the deployment's pull step may lead the run there.
            cwd=cwd,
            env=server.env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        return proc.wait(timeout=WORKER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return -1
    finally:
        stop(proc, sigterms=2)


@pytest.mark.timeout(600)
def test_eagle3_deployment_runs_tiny_recipe_on_process_worker(prefect_server: Server, tmp_path: Path) -> None:
    server = prefect_server
    t0 = time.monotonic()

    _cli(server, "work-pool", "create", "local-cpu", "--type", "process")
    _cli(server, "--no-prompt", "deploy", "--all", "--prefect-file", str(PREFECT_FILE.relative_to(ROOT)))

    deployment = get_json(f"{server.api_url}/deployments/name/kimi-k3/eagle3")
    assert deployment["entrypoint"] == "flows/pipeline.py:kimi_k3"
    # The default config is the main recipe, verbatim and valid.
    main_recipe = yaml.safe_load((RECIPES / "smollm2-cpu-eagle3.yaml").read_text())
    assert deployment["parameters"]["config"] == main_recipe
    PipelineConfig.model_validate(deployment["parameters"]["config"])
    subflow = get_json(f"{server.api_url}/deployments/name/hidden-states/smollm2-cpu")
    assert subflow["entrypoint"] == "flows/hidden_states.py:hidden_states_flow"
    assert subflow["parameters"]["config"] == main_recipe
    for kind in ["dflash2", "dspark"]:
        block = get_json(f"{server.api_url}/deployments/name/kimi-k3/{kind}")
        assert block["entrypoint"] == "flows/pipeline.py:kimi_k3"
        assert block["parameters"]["config"] == yaml.safe_load((RECIPES / f"smollm2-cpu-{kind}.yaml").read_text())
    # Flow runs start in the repository root: the pull step holds the absolute directory deploy ran in.
    pull_dirs = [
        step["prefect.deployments.steps.set_working_directory"]["directory"]
        for step in deployment["pull_steps"] or []
        if "prefect.deployments.steps.set_working_directory" in step
    ]
    assert [Path(d).resolve() for d in pull_dirs] == [ROOT.resolve()], deployment["pull_steps"]
    print(f"work pool + deploy: {time.monotonic() - t0:.1f} s")

    run_dir = tmp_path / "run"
    params = {
        "config": yaml.safe_load((RECIPES / "tiny-cpu.yaml").read_text()),
        "run_dir": str(run_dir),
    }
    out = _cli(server, "deployment", "run", "kimi-k3/eagle3", "--params", json.dumps(params))
    ids = re.findall(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", out)
    assert ids, f"no flow run id in `prefect deployment run` output:\n{out}"
    flow_run_id = ids[0]

    worker_log = tmp_path / "worker.log"
    (worker_cwd := tmp_path / "worker-cwd").mkdir()
    t1 = time.monotonic()
    worker_rc = _run_worker(server, worker_log, worker_cwd)
    worker_out = tail(worker_log)
    # Shown by pytest whenever the test fails (and always with -s).
    print(f"worker exited {worker_rc} after {time.monotonic() - t1:.1f} s; output:\n{worker_out}")

    flow_run = get_json(f"{server.api_url}/flow_runs/{flow_run_id}")
    state = flow_run["state"] or {}
    assert (state.get("type"), state.get("name")) == ("COMPLETED", "Completed"), (
        f"flow run {flow_run_id} ended {state.get('type')}/{state.get('name')}: {state.get('message')}\n"
        f"worker output (exit {worker_rc}):\n{worker_out}"
    )
    assert worker_rc == 0, f"worker exited {worker_rc}:\n{worker_out}"
    assert flow_run["parameters"]["run_dir"] == str(run_dir)

    results_path = run_dir / "evaluate" / "results.json"
    assert results_path.is_file(), f"{results_path} missing; worker output:\n{worker_out}"
    results = json.loads(results_path.read_text())
    assert {"drafter", "acc_len", "tokens_per_s"} <= results.keys(), results
    print(f"total {time.monotonic() - t0:.1f} s after the server was healthy; results: {results}")
