"""The gb200 base job template: loads, validates, renders completely; broken copies are caught by field."""

import json
from copy import deepcopy

import pytest
from prefect.server.schemas.actions import validate_base_job_template as prefect_server_validate
from prefect.utilities.templating import find_placeholders

from draftsmith.config import load_recipe
from draftsmith.config.stages import Resources
from draftsmith.pools import (
    GPU_RESOURCE,
    WORK_POOLS_DIR,
    gpu_count_default,
    gpu_limit_commands,
    gpu_limit_name,
    load_base_job_template,
    pool_template_path,
    render,
    validate_base_job_template,
)

pytestmark = pytest.mark.unit
RECIPES = WORK_POOLS_DIR.parent / "recipes"
# Variables a worker fills per flow run; they have no default in the template.
WORKER_VALUES = {"name": "clever-otter", "command": "prefect flow-run execute"}


@pytest.fixture
def template() -> dict:
    return load_base_job_template("gb200")


def _pod(tpl_or_cfg: dict) -> dict:
    cfg = tpl_or_cfg.get("job_configuration", tpl_or_cfg)
    return cfg["job_manifest"]["spec"]["template"]["spec"]


def _one_problem(template: dict, *needles: str) -> str:
    problems = validate_base_job_template(template)
    assert len(problems) == 1, problems
    for needle in needles:
        assert needle in problems[0], problems
    return problems[0]


def test_gb200_template_loads_and_validates(template: dict) -> None:
    assert template == json.loads(pool_template_path("gb200").read_text())
    assert validate_base_job_template(template) == []
    # The Prefect server's own check (run on `work-pool create`) accepts it too.
    prefect_server_validate(template)
    props = template["variables"]["properties"]
    assert props["image"]["default"] == "ghcr.io/draftsmith/draftsmith:gpu"
    assert props["node_selector"]["default"] == {"nvidia.com/gpu.product": "NVIDIA-GB200"}
    assert gpu_count_default(template) == 4


def test_every_variable_is_used_and_described(template: dict) -> None:
    used = {p.name for p in find_placeholders(template["job_configuration"])}
    assert used == set(template["variables"]["properties"])
    assert all(spec.get("description") for spec in template["variables"]["properties"].values())


def test_missing_template_names_the_file() -> None:
    with pytest.raises(FileNotFoundError, match=r"'no-such-pool'.*no-such-pool\.json.*gb200"):
        load_base_job_template("no-such-pool")


def test_placeholder_without_variable_is_named(template: dict) -> None:
    del template["variables"]["properties"]["shm_size"]
    _one_problem(template, "job_configuration.job_manifest", "{{ shm_size }}", "variables.properties.shm_size")
    with pytest.raises(ValueError, match="shm_size"):
        prefect_server_validate(template)


def test_missing_shm_is_named(template: dict) -> None:
    broken = deepcopy(template)
    _pod(broken)["containers"][0]["volumeMounts"] = []
    _one_problem(broken, "containers[0].volumeMounts", "/dev/shm")
    broken = deepcopy(template)
    del _pod(broken)["volumes"][0]["emptyDir"]["medium"]
    _one_problem(broken, "volumes.dshm", "medium Memory")
    broken = deepcopy(template)
    _pod(broken)["volumes"] = []
    _one_problem(broken, "spec.volumes", "'dshm'")


def test_fixed_or_missing_gpu_limit_is_named(template: dict) -> None:
    broken = deepcopy(template)
    _pod(broken)["containers"][0]["resources"]["limits"][GPU_RESOURCE] = 4
    _one_problem(broken, f"limits.{GPU_RESOURCE}", "placeholder")
    broken = deepcopy(template)
    del _pod(broken)["containers"][0]["resources"]["limits"][GPU_RESOURCE]
    _one_problem(broken, f"limits.{GPU_RESOURCE}", "missing")
    broken = deepcopy(template)
    del broken["variables"]["properties"]["gpu_count"]["default"]
    _one_problem(broken, "variables.properties.gpu_count", "default >= 1")


def test_worker_requirements_and_node_selector_are_named(template: dict) -> None:
    broken = deepcopy(template)
    del _pod(broken)["nodeSelector"]
    _one_problem(broken, "spec.nodeSelector")
    broken = deepcopy(template)
    _pod(broken)["containers"][0]["name"] = "vllm"
    _one_problem(broken, "containers[0].name", "prefect-job")
    broken = deepcopy(template)
    _pod(broken)["restartPolicy"] = "OnFailure"
    _one_problem(broken, "restartPolicy")
    broken = deepcopy(template)
    del broken["variables"]["properties"]["image"]["description"]
    _one_problem(broken, "variables.properties.image", "description")
    assert validate_base_job_template({"variables": {}}) == [
        "base job template: needs both a `job_configuration` and a `variables` object"
    ]


def test_defaults_render_every_placeholder(template: dict) -> None:
    rendered = render(template, WORKER_VALUES)
    assert not find_placeholders(rendered), find_placeholders(rendered)
    # Only the two optional settings without a default drop out (the worker then uses its own).
    assert set(template["job_configuration"]) - set(rendered) == {"cluster_config", "job_watch_timeout_seconds"}
    manifest = rendered["job_manifest"]
    pod = _pod(rendered)
    container = pod["containers"][0]
    assert manifest["metadata"] == {
        "labels": {"app.kubernetes.io/part-of": "draftsmith"},
        "namespace": "draftsmith",
        "generateName": "clever-otter-",
    }
    assert manifest["spec"]["backoffLimit"] == 0 and manifest["spec"]["ttlSecondsAfterFinished"] == 86400
    assert container["image"] == "ghcr.io/draftsmith/draftsmith:gpu"
    assert container["resources"]["limits"][GPU_RESOURCE] == 4 == container["resources"]["requests"][GPU_RESOURCE]
    assert container["args"] == "prefect flow-run execute"
    assert container["volumeMounts"] == [{"name": "dshm", "mountPath": "/dev/shm"}]
    assert pod["volumes"] == [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}}]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-GB200"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["serviceAccountName"] == "draftsmith"


def test_job_variables_override_defaults(template: dict) -> None:
    rendered = render(template, WORKER_VALUES | {"gpu_count": 2, "shm_size": "128Gi", "namespace": "research"})
    container = _pod(rendered)["containers"][0]
    assert container["resources"]["limits"][GPU_RESOURCE] == 2 == container["resources"]["requests"][GPU_RESOURCE]
    assert _pod(rendered)["volumes"][0]["emptyDir"]["sizeLimit"] == "128Gi"
    assert rendered["namespace"] == rendered["job_manifest"]["metadata"]["namespace"] == "research"


def test_recipe_stages_on_gb200_fit_one_pod(template: dict) -> None:
    """Every stage a shipped recipe puts on a pool with a template asks for that template's GPUs per node."""
    pools_with_templates = {p.stem for p in WORK_POOLS_DIR.glob("*.json")}
    checked = 0
    for recipe in sorted(RECIPES.glob("*.yaml")):
        cfg = load_recipe(recipe)
        for stage in type(cfg).model_fields:
            resources = getattr(getattr(cfg, stage), "resources", None)
            if isinstance(resources, Resources) and resources.work_pool in pools_with_templates:
                tpl = load_base_job_template(resources.work_pool)
                assert resources.gpus == gpu_count_default(tpl), f"{recipe.name}: {stage}.resources.gpus"
                checked += 1
    assert checked >= 3  # kimi-k3-eagle3: regenerate, hidden_states, evaluate


def test_gpu_limit_commands() -> None:
    assert gpu_limit_name("gb200") == "gpu:gb200"
    assert gpu_limit_commands("gb200", 4) == [
        ["prefect", "work-pool", "create", "gb200", "--type", "kubernetes"]
        + ["--base-job-template", str(WORK_POOLS_DIR / "gb200.json")],
        ["prefect", "work-pool", "set-concurrency-limit", "gb200", "1"],
        ["prefect", "gcl", "create", "gpu:gb200", "--limit", "4"],
    ]
    # 16 GPUs = four 4-GPU pods at once; 2-GPU runs double that.
    assert gpu_limit_commands("gb200", 16)[1][-1] == "4"
    assert gpu_limit_commands("gb200", 16, gpus_per_run=2)[1][-1] == "8"
    with pytest.raises(ValueError, match=r"gpus \(6\).*gpus_per_run \(4\)"):
        gpu_limit_commands("gb200", 6)
    with pytest.raises(FileNotFoundError, match="gb200-train"):
        gpu_limit_commands("gb200-train", 8)
