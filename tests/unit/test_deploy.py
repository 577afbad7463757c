"""`draftsmith deploy` before it talks to a server: the inventory, the prefect file, pool settings and arguments,
each wrong input refused naming its file and field. (tests/e2e/test_deploy_cluster.py runs it against a server.)"""

from pathlib import Path

import pytest
import yaml

from draftsmith.cli_deploy import _gpu_overrides
from draftsmith.deploy import (
    INVENTORY,
    PREFECT_FILE,
    DeployError,
    deploy,
    load_inventory,
    load_prefect_file,
    pool_settings,
    pools_used,
)
from draftsmith.pools import load_base_job_template

pytestmark = pytest.mark.unit


def _write(tmp_path: Path, name: str, doc) -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _inventory_doc() -> dict:
    return yaml.safe_load(INVENTORY.read_text())


def test_committed_inventory_settings() -> None:
    inventory = load_inventory()
    assert {name: spec.type for name, spec in inventory.pools.items()} == {
        "local": "process",
        "local-gpu": "process",
        "cpu": "kubernetes",
        "gb200": "kubernetes",
        "gb200-train": "kubernetes",
    }
    # (template, flow runs at a time, GPU slots): 16 GB200 GPUs hold four 4-GPU pods; 8 hold one 2 x 4 job.
    assert pool_settings("gb200", inventory.pools["gb200"])[1:] == (4, 16)
    assert pool_settings("gb200-train", inventory.pools["gb200-train"])[1:] == (1, 8)
    assert pool_settings("gb200-train", inventory.pools["gb200-train"], gpus=32)[1:] == (4, 32)
    template, limit, slots = pool_settings("local", inventory.pools["local"])
    assert (template, limit, slots) == (load_base_job_template("local"), 1, 0)
    with pytest.raises(
        DeployError, match=r"work pool 'gb200-train': gpus \(12\) must be a positive multiple of .* \(8\)"
    ):
        pool_settings("gb200-train", inventory.pools["gb200-train"], gpus=12)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda d: d["pools"]["cpu"].update(type="docker"),
            r"pools\.cpu\.type: Input should be 'process' or 'kubernetes'",
        ),
        (
            lambda d: d["pools"]["gb200"].update(concurrency_limit=2),
            r"pools\.gb200: concurrency_limit: a GPU pool derives",
        ),
        (lambda d: d["pools"]["local"].update(colour="red"), r"pools\.local\.colour: Extra inputs are not permitted"),
        (
            lambda d: d["result_storage"].update(basepath="draftsmith-runs"),
            r"result_storage: basepath: .* is not a URL",
        ),
        (
            lambda d: d["result_storage"].update(basepath="s3://key:secret@bucket/results"),
            r"result_storage: basepath: credentials in the URL",
        ),
    ],
)
def test_bad_inventory_is_named(tmp_path: Path, edit, message: str) -> None:
    doc = _inventory_doc()
    edit(doc)
    path = _write(tmp_path, "pools.yaml", doc)
    with pytest.raises(DeployError, match=rf"{path}: {message}"):
        load_inventory(path)


def test_prefect_file_problems_are_named(tmp_path: Path) -> None:
    doc = yaml.safe_load(PREFECT_FILE.read_text())
    with pytest.raises(DeployError, match="no prefect file there"):
        load_prefect_file(tmp_path / "absent.yaml")
    path = _write(tmp_path, "empty.yaml", {"name": "x", "deployments": []})
    with pytest.raises(DeployError, match=r"empty\.yaml: deployments: none defined"):
        load_prefect_file(path)
    doc["deployments"] = doc["deployments"][:2]
    doc["deployments"][1]["entrypoint"] = "flows/absent.py:flow"
    path = _write(tmp_path, "missing-flow.yaml", doc)
    with pytest.raises(
        DeployError, match=r"deployments\[1\]\.entrypoint: .*flows/absent\.py does not exist \(dflash2\)"
    ):
        load_prefect_file(path)
    doc["deployments"][1]["entrypoint"] = "flows/pipeline.py:kimi_k3"
    doc["deployments"][1]["work_pool"] = {"name": "gb300"}
    path = _write(tmp_path, "unknown-pool.yaml", doc)
    with pytest.raises(
        DeployError, match=r"deployments\[1\]\.work_pool\.name: 'gb300' \(dflash2\) is not in pools\.yaml"
    ):
        pools_used(load_prefect_file(path), load_inventory(), path)
    del doc["deployments"][1]["work_pool"]
    path = _write(tmp_path, "no-pool.yaml", doc)
    with pytest.raises(DeployError, match=r"deployments\[1\]\.work_pool\.name: missing \(dflash2\)"):
        load_prefect_file(path)


def test_pools_used_in_first_use_order() -> None:
    doc = yaml.safe_load(PREFECT_FILE.read_text())
    assert pools_used(doc["deployments"], load_inventory(), PREFECT_FILE) == ["cpu", "gb200", "gb200-train"]


def test_deploy_refuses_before_touching_a_server(tmp_path: Path, monkeypatch) -> None:
    """Wrong --gpus and a missing PREFECT_API_URL stop it before any write (no server exists here)."""
    doc = yaml.safe_load(PREFECT_FILE.read_text())
    doc["deployments"] = [d for d in doc["deployments"] if d["entrypoint"] != "flows/nightly.py:nightly_regression"]
    path = _write(tmp_path, "prefect.yaml", doc)
    with pytest.raises(DeployError, match=r"--gpus \['cpu'\]: not GPU pools of .* \['gb200', 'gb200-train'\]"):
        deploy(path, local=False, gpus={"cpu": 4})
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: None}):
        with pytest.raises(DeployError, match="PREFECT_API_URL is not set"):
            deploy(path, local=False)


def test_gpu_overrides_parse() -> None:
    assert _gpu_overrides(["gb200=32", "gb200-train=16"]) == {"gb200": 32, "gb200-train": 16}
    for bad in ["gb200", "gb200=", "=4", "gb200=0", "gb200=four"]:
        with pytest.raises(ValueError, match=rf"--gpus '{bad}': expected POOL=N"):
            _gpu_overrides([bad])
