"""`draftsmith deploy` of the cluster's prefect.yaml against a real Prefect server: the cpu, gb200 and gb200-train
Kubernetes pools are created from their templates, with their limits and the result-storage block, and
`prefect deploy --all` validates every deployment (parameters against the flow's schema, job variables against the
pool's) on the server. Nothing runs on those pools. Run twice, it changes nothing; a job variable outside the
pool's schema is refused by the server. A 4-GPU stage then holds 4 of the 16 `gpu:gb200` slots as the hidden-state
stage does, and a request beyond the free slots waits. Then Prefect results really land in S3 through that block,
as JSON, with the credentials in the environment only (SeaweedFS on loopback).

No Kubernetes cluster and no `prefect-kubernetes` are needed: the server knows the kubernetes pool type from its
bundled worker metadata; only a kubernetes *worker* needs that package.
"""

import json
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from draftsmith.core.config import PipelineConfig, load_recipe
from draftsmith.core.config.stages import Resources
from draftsmith.core.gpus import gpu_limit_name, gpu_slots
from draftsmith.deploy import load_inventory
from draftsmith.pools import gpu_limit_commands, load_base_job_template
from tests.support.prefect import DRAFTSMITH, PREFECT, ROOT, Server, deployable_copy, get_json, run_cli
from tests.support.s3 import weed_s3

PREFECT_FILE = ROOT / "deployments" / "prefect.yaml"
RECIPES = ROOT / "deployments" / "recipes"

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _check_pools(server: Server) -> None:
    inventory = load_inventory()
    for name, limit in [("cpu", 8), ("gb200", 4), ("gb200-train", 1)]:
        pool = get_json(f"{server.api_url}/work_pools/{name}")
        assert (pool["type"], pool["concurrency_limit"]) == ("kubernetes", limit), name
        assert pool["base_job_template"] == load_base_job_template(name), name
        assert pool["description"] == inventory.pools[name].description
    for name, slots in [("gpu:gb200", 16), ("gpu:gb200-train", 8)]:
        gcl = get_json(f"{server.api_url}/v2/concurrency_limits/{name}")
        assert (gcl["limit"], gcl["active"]) == (slots, True), name
    block = get_json(f"{server.api_url}/block_types/slug/remote-file-system/block_documents/name/draftsmith-results")
    assert inventory.result_storage is not None
    assert block["data"] == {"basepath": inventory.result_storage.basepath, "settings": {}}


def _check_deployments(server: Server, left_out: list[str]) -> None:
    for kind in ["eagle3", "dflash2", "dspark"]:
        recipe = load_recipe(RECIPES / f"kimi-k3-{kind}.yaml")
        dep = get_json(f"{server.api_url}/deployments/name/kimi-k3/{kind}")
        assert (dep["work_pool_name"], dep["entrypoint"]) == ("cpu", "flows/pipeline.py:kimi_k3")
        assert dep["job_variables"]["cpu_request"] == str(recipe.tokenize.resources.cpus)
        assert dep["global_concurrency_limit"]["limit"] == 1
        assert PipelineConfig.model_validate(dep["parameters"]["config"]) == recipe
        assert dep["pull_steps"] == [
            {"prefect.deployments.steps.set_working_directory": {"directory": "/opt/draftsmith"}}
        ]
        stage = get_json(f"{server.api_url}/deployments/name/hidden-states/kimi-k3-{kind}")
        assert (stage["work_pool_name"], stage["job_variables"]["gpu_count"]) == ("gb200", 4)
    for pool in ["cpu", "gb200", "gb200-train"]:  # where the pipeline dispatches the stages of other pools
        dep = get_json(f"{server.api_url}/deployments/name/stage/{pool}")
        assert (dep["work_pool_name"], dep["entrypoint"], dep["parameters"]) == (pool, "flows/stages.py:stage_flow", {})
        assert set(dep["parameter_openapi_schema"]["required"]) == {"config", "stage", "run_dir"}
    if "nightly-regression" in left_out:
        return
    [nightly] = [
        d
        for d in _post(server, "deployments/filter", {"deployments": {"name": {"any_": ["nightly-regression"]}}})
        if d["entrypoint"] == "flows/nightly.py:nightly_regression"
    ]
    assert nightly["work_pool_name"] == "cpu" and nightly["parameters"] == {}
    [schedule] = nightly["schedules"]
    assert (schedule["schedule"]["cron"], schedule["schedule"]["timezone"], schedule["active"]) == (
        "0 2 * * *",
        "UTC",
        True,
    )


def _post(server: Server, path: str, body: dict) -> list[dict]:
    import urllib.request

    from tests.support.prefect import HTTP

    req = urllib.request.Request(
        f"{server.api_url}/{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with HTTP.open(req, timeout=30) as resp:
        return json.loads(resp.read())


def _refused_job_variable(server: Server, tmp_path: Path) -> None:
    """9 GPUs on a 4-GPU node: the server checks job variables against the pool's template and says so."""
    doc = yaml.safe_load(PREFECT_FILE.read_text())
    doc["deployments"] = [d for d in doc["deployments"] if d["name"] == "kimi-k3-dspark"]
    doc["deployments"][0]["work_pool"]["job_variables"]["gpu_count"] = 9
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc, sort_keys=False))
    res = subprocess.run(
        [str(DRAFTSMITH), "deploy", "--prefect-file", str(bad)],
        cwd=ROOT,
        env=server.env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 2 and "9 is greater than the maximum of 4" in res.stderr, res.stdout + res.stderr
    stage = get_json(f"{server.api_url}/deployments/name/hidden-states/kimi-k3-dspark")
    assert stage["job_variables"]["gpu_count"] == 4  # the stored deployment is untouched


def _occupy_gpus(server: Server) -> None:
    """`gpu_slots` of a 4-GPU stage holds 4 slots of `gpu:gb200`; 13 more do not fit until it lets go."""
    from prefect.concurrency.sync import concurrency
    from prefect.events.worker import EventsWorker
    from prefect.settings import PREFECT_API_URL, temporary_settings

    name = gpu_limit_name("gb200")
    url = f"{server.api_url}/v2/concurrency_limits/{name}"
    with temporary_settings({PREFECT_API_URL: server.api_url}):
        try:
            with gpu_slots(Resources(work_pool="gb200", gpus=4)):
                assert get_json(url)["active_slots"] == 4
                with pytest.raises(TimeoutError):
                    with concurrency(name, occupy=13, timeout_seconds=1, strict=True):
                        pass
            assert get_json(url)["active_slots"] == 0
        finally:
            # The slots emit events through a process-wide EventsWorker bound to this server. Drained and
            # stopped while the server is up, so a later test's server gets a fresh worker, not a dead URL
            # (test_flow's task runs, recorded from events, went missing otherwise).
            EventsWorker.drain_all()


def _cli_commands_see_the_same_pool(server: Server) -> None:
    """`gpu_limit_commands`, the CLI route README.md documents, names the pool deploy created: creating it again is
    refused by name, not silently changed."""
    argv = gpu_limit_commands("gb200", 16)[0]
    res = subprocess.run(
        [str(PREFECT), *argv[1:]], cwd=ROOT, env=server.env, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 1 and "already exists" in res.stdout + res.stderr, res.stdout + res.stderr


RESULT_FLOW = """
from prefect import flow, task
from draftsmith.core.manifest import StageManifest

@task(persist_result=True)
def stage() -> StageManifest:
    return StageManifest(stage="probe", key="k" * 8, uri="s3://draftsmith-runs/probe", counts={"rows": 42})

@flow
def results_on_s3() -> int:
    return stage().counts["rows"]

assert results_on_s3() == 42
"""


def _results_land_on_s3(server: Server, tmp_path: Path) -> None:
    """A flow run with the deployments' env persists its task result under the block's s3:// base path."""
    import s3fs

    storage_block = load_inventory().result_storage
    assert storage_block is not None
    basepath = storage_block.basepath
    bucket = basepath.removeprefix("s3://").split("/")[0]
    (data := tmp_path / "s3").mkdir()
    with weed_s3(data, bucket=bucket) as s3_env:
        env = server.env | s3_env
        env |= yaml.safe_load(PREFECT_FILE.read_text())["definitions"]["job_variables"]["cluster_env"]
        script = tmp_path / "results_on_s3.py"
        script.write_text(textwrap.dedent(RESULT_FLOW))
        res = subprocess.run(
            [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180
        )
        assert res.returncode == 0, res.stdout + res.stderr
        fs = s3fs.S3FileSystem(
            endpoint_url=s3_env["AWS_ENDPOINT_URL"],
            key=s3_env["AWS_ACCESS_KEY_ID"],
            secret=s3_env["AWS_SECRET_ACCESS_KEY"],
            skip_instance_cache=True,
        )
        stored = [p for p in fs.find(basepath.removeprefix("s3://")) if fs.size(p)]
        assert stored, f"no result under {basepath}; flow output:\n{res.stdout}{res.stderr}"
        # JSON, not pickle: the stage's manifest as data, loadable only as that pydantic class.
        records = [r for r in map(json.loads, map(fs.cat_file, stored)) if isinstance(r, dict)]
        manifests = [json.loads(r["result"]) for r in records if r["metadata"]["serializer"]["type"] == "json"]
        assert [(m["__class__"], m["data"]["counts"]) for m in manifests] == [
            ("draftsmith.core.manifest.StageManifest", {"rows": 42})
        ], records


@pytest.mark.timeout(600)
def test_cluster_deploy_validates_on_a_server_idempotently(prefect_server: Server, tmp_path: Path) -> None:
    server = prefect_server
    prefect_file, left_out = deployable_copy(PREFECT_FILE, tmp_path)
    t0 = time.monotonic()
    first = run_cli(server, [DRAFTSMITH, "deploy", "--prefect-file", prefect_file])
    print(f"first deploy {time.monotonic() - t0:.1f} s (without {left_out}):\n{first}")
    lines = [
        line
        for line in first.splitlines()
        if re.match(r"(work pool|concurrency limit|result storage|deployment) ", line)
    ]
    # The pools and their limits (6 lines), 9 deployments, and the nightly unless it was left out.
    assert len(lines) == 6 + 9 + (0 if "nightly-regression" in left_out else 1), first
    assert all(re.search(r"\s(created|created \(\d+ slots\))$", line) for line in lines), first
    _check_pools(server)
    _check_deployments(server, left_out)

    t1 = time.monotonic()
    second = run_cli(server, [DRAFTSMITH, "deploy", "--prefect-file", prefect_file])
    print(f"second deploy {time.monotonic() - t1:.1f} s:\n{second}")
    again = [
        line for line in second.splitlines() if line.split(" ")[0] in {"work", "concurrency", "result", "deployment"}
    ]
    assert len(again) == len(lines) and all(line.endswith(" unchanged") for line in again), second
    assert f"{len(lines)} objects, 0 created or updated" in second
    _check_pools(server)

    _refused_job_variable(server, tmp_path)
    _cli_commands_see_the_same_pool(server)
    _occupy_gpus(server)
    _results_land_on_s3(server, tmp_path)
    print(f"total {time.monotonic() - t0:.1f} s")
