"""The gb200 and gb200-train base job templates: load, validate, render completely; broken copies are caught by
field. gb200-train's pod command is run through /bin/sh to show which pods run the flow and which follow."""

import json
import subprocess
from copy import deepcopy

import pytest
import yaml
from prefect.server.schemas.actions import validate_base_job_template as prefect_server_validate
from prefect.utilities.templating import find_placeholders

from draftsmith.core.config import load_recipe
from draftsmith.core.config.stages import Resources
from draftsmith.deploy import load_inventory
from draftsmith.pools import (
    GPU_RESOURCE,
    WORK_POOLS_DIR,
    gpu_count_default,
    gpu_limit_commands,
    gpu_limit_name,
    is_multi_node,
    load_base_job_template,
    nodes_default,
    pool_template_path,
    render,
    validate_base_job_template,
    validate_pool_template,
    validate_process_template,
)

pytestmark = pytest.mark.unit
RECIPES = WORK_POOLS_DIR.parent / "recipes"
# Variables a worker fills per flow run; they have no default in the template.
WORKER_VALUES = {"name": "clever-otter", "command": "prefect flow-run execute"}
_POD_PATH = "job_configuration.job_manifest.spec.template.spec"


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


@pytest.mark.parametrize("pool", ["gb200", "gb200-train"])
def test_every_variable_is_used_and_described(pool: str) -> None:
    template = load_base_job_template(pool)
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


def test_recipe_stages_fit_their_pool(template: dict) -> None:
    """Every stage of a shipped recipe names a pool of the inventory: a GPU pool's stages ask for its template's GPUs
    and nodes, a CPU pool's stages for no GPU."""
    inventory = load_inventory()
    checked = {"gpu": 0, "cpu": 0}
    for recipe in sorted(RECIPES.glob("*.yaml")):
        cfg = load_recipe(recipe)
        for stage in type(cfg).model_fields:
            resources = getattr(getattr(cfg, stage), "resources", None)
            if not isinstance(resources, Resources):
                continue
            where = f"{recipe.name}: {stage}.resources"
            assert resources.work_pool in inventory.pools, f"{where}.work_pool {resources.work_pool!r}"
            if not inventory.pools[resources.work_pool].gpus:
                assert resources.gpus == 0, f"{where}.gpus: {resources.work_pool!r} is a CPU pool"
                checked["cpu"] += 1
                continue
            tpl = load_base_job_template(resources.work_pool)
            assert resources.gpus == gpu_count_default(tpl), f"{where}.gpus"
            if is_multi_node(tpl):  # one job holds all nodes; on gb200 each node is a flow run of its own
                assert resources.nodes == nodes_default(tpl), f"{where}.nodes"
            checked["gpu"] += 1
    # kimi-k3-*: regenerate, hidden_states, evaluate on gb200, train on gb200-train; the rest on cpu or local.
    assert checked["gpu"] >= 12 and checked["cpu"] >= 12, checked


@pytest.mark.parametrize("pool", ["cpu", "local"])
def test_cpu_templates_validate_and_take_no_gpu(pool: str) -> None:
    template = load_base_job_template(pool)
    kind = "process" if pool == "local" else "kubernetes"
    assert validate_pool_template(kind, template, gpu=False) == []
    prefect_server_validate(template)
    used = {p.name for p in find_placeholders(template["job_configuration"])}
    assert used == set(template["variables"]["properties"])
    assert all(spec.get("description") for spec in template["variables"]["properties"].values())
    # A GPU pool cannot be a process pool, and the CPU template is refused where GPUs are expected.
    assert validate_pool_template("process", template, gpu=True) != []
    if kind == "kubernetes":
        assert any("nvidia.com/gpu: missing" in p for p in validate_pool_template(kind, template, gpu=True))
        rendered = render(template, WORKER_VALUES)
        assert rendered["job_manifest"]["spec"]["template"]["spec"]["nodeSelector"] == {
            "draftsmith.io/node-class": "cpu"
        }


def test_cpu_template_problems_are_named() -> None:
    template = load_base_job_template("cpu")
    with_gpu = deepcopy(template)
    _pod(with_gpu)["containers"][0]["resources"]["limits"][GPU_RESOURCE] = 1
    assert validate_pool_template("kubernetes", with_gpu, gpu=False) == [
        f"{_POD_PATH}.containers[0].resources.limits.{GPU_RESOURCE}: a CPU pool must not take GPUs"
    ]
    no_secret = deepcopy(template)
    del _pod(no_secret)["containers"][0]["envFrom"]
    _one_problem_of(no_secret, "envFrom", "secretRef")
    literal = deepcopy(template)
    literal["variables"]["properties"]["env"]["default"]["AWS_SECRET_ACCESS_KEY"] = "not-here"
    _one_problem_of(literal, "env.default.AWS_SECRET_ACCESS_KEY", "looks like a credential")


def test_process_template_problems_are_named() -> None:
    template = load_base_job_template("local")
    fixed = deepcopy(template)
    fixed["job_configuration"]["working_dir"] = "/tmp"
    assert validate_process_template(fixed) == [
        "job_configuration.working_dir: must be {{ working_dir }} (the process worker fills it)"
    ]
    leaked = deepcopy(template)
    leaked["variables"]["properties"]["env"]["default"]["HF_TOKEN"] = "hf_x"
    assert validate_process_template(leaked) == [
        "variables.properties.env.default.HF_TOKEN: looks like a credential; reference a Secret instead"
    ]
    assert validate_pool_template("docker", template, gpu=False) == [
        "pool type 'docker': only 'process' and 'kubernetes' templates are kept here"
    ]


def _one_problem_of(template: dict, *needles: str) -> None:
    problems = validate_pool_template("kubernetes", template, gpu=False)
    assert len(problems) == 1 and all(n in problems[0] for n in needles), problems


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
    # A gb200-train run is 2 pods x 4 GPUs: 8 GPUs hold one run, 16 hold two.
    assert gpu_limit_commands("gb200-train", 8)[1:] == [
        ["prefect", "work-pool", "set-concurrency-limit", "gb200-train", "1"],
        ["prefect", "gcl", "create", "gpu:gb200-train", "--limit", "8"],
    ]
    assert gpu_limit_commands("gb200-train", 16)[1][-1] == "2"
    with pytest.raises(ValueError, match=r"gpus \(4\).*gpus_per_run \(8\)"):
        gpu_limit_commands("gb200-train", 4)
    with pytest.raises(FileNotFoundError, match="no-such-pool"):
        gpu_limit_commands("no-such-pool", 8)


# --- gb200-train: one Indexed Job per flow run, one pod per node ---------------------------------------------


@pytest.fixture
def train_template() -> dict:
    return load_base_job_template("gb200-train")


def _env(rendered: dict) -> dict[str, dict]:
    return {e["name"]: e for e in _pod(rendered)["containers"][0]["env"]}


def test_gb200_train_template_validates(train_template: dict) -> None:
    assert is_multi_node(train_template) and not is_multi_node(load_base_job_template("gb200"))
    assert validate_base_job_template(train_template) == []
    prefect_server_validate(train_template)
    assert (gpu_count_default(train_template), nodes_default(train_template)) == (4, 2)
    # Same GB200 placement and worker requirements as gb200.
    gb200 = load_base_job_template("gb200")["variables"]["properties"]
    props = train_template["variables"]["properties"]
    for name in ("node_selector", "tolerations", "image", "shm_size", "backoff_limit"):
        assert props[name]["default"] == gb200[name]["default"], name


def test_gb200_train_renders_an_indexed_job_with_the_rendezvous_env(train_template: dict) -> None:
    rendered = render(train_template, WORKER_VALUES)
    assert not find_placeholders(rendered), find_placeholders(rendered)
    spec = rendered["job_manifest"]["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"], spec["backoffLimit"]) == (
        "Indexed", 2, 2, 0,
    )  # fmt: skip
    assert spec["successPolicy"] == {"rules": [{"succeededIndexes": "0"}]}
    assert spec["template"]["metadata"]["labels"] == {"draftsmith.io/rdzv-service": "draftsmith-train"}
    pod = _pod(rendered)
    assert pod["subdomain"] == "draftsmith-train"
    # Where the Prefect kubernetes worker's manifest check looks for them (the pod template, not the job spec).
    assert (pod["parallelism"], pod["completions"], pod["restartPolicy"]) == (1, 1, "Never")
    env = _env(rendered)
    assert env["DRAFTSMITH_RDZV_ENDPOINT"]["value"] == "$(DRAFTSMITH_JOB_NAME)-0.draftsmith-train:29400"
    assert env["DRAFTSMITH_JOB_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.labels['job-name']"}}
    index = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert env["DRAFTSMITH_NODE_RANK"]["valueFrom"] == {"fieldRef": {"fieldPath": index}}
    # Kubernetes expands $(DRAFTSMITH_STR) to "", so these are the strings "2" and "4" in the pod.
    assert env["DRAFTSMITH_NNODES"]["value"] == "2$(DRAFTSMITH_STR)" and env["DRAFTSMITH_STR"]["value"] == ""
    assert env["DRAFTSMITH_NPROC_PER_NODE"]["value"] == "4$(DRAFTSMITH_STR)"
    assert env["NCCL_SOCKET_IFNAME"]["value"] == env["GLOO_SOCKET_IFNAME"]["value"] == "eth0"
    assert pod["containers"][0]["args"] == "prefect flow-run execute"
    # job_variables resize the job and everything derived from it.
    rendered = render(train_template, WORKER_VALUES | {"nnodes": 4, "gpu_count": 2, "rdzv_port": 29500})
    spec, env = rendered["job_manifest"]["spec"], _env(rendered)
    assert (spec["completions"], spec["parallelism"]) == (4, 4)
    assert (env["DRAFTSMITH_NNODES"]["value"], env["DRAFTSMITH_NPROC_PER_NODE"]["value"]) == (
        "4$(DRAFTSMITH_STR)", "2$(DRAFTSMITH_STR)",
    )  # fmt: skip
    assert env["DRAFTSMITH_RDZV_ENDPOINT"]["value"].endswith("-0.draftsmith-train:29500")


@pytest.mark.parametrize(("index", "runs"), [("0", "flow-run 7f3a"), ("1", "follower"), ("3", "follower")])
def test_only_pod_0_runs_the_flow(train_template: dict, index: str, runs: str) -> None:
    """The container command, run by /bin/sh as Kubernetes would: pod 0 execs the worker's flow-run command,
    the others the follower command."""
    rendered = render(train_template, WORKER_VALUES | {"follower_command": "echo follower"})
    container = _pod(rendered)["containers"][0]
    argv = container["command"] + ["echo", "flow-run", "7f3a"]  # the worker splits `args` into a list
    res = subprocess.run(argv, env={"JOB_COMPLETION_INDEX": index}, capture_output=True, text=True, timeout=10)
    assert (res.returncode, res.stdout.strip()) == (0, runs), res.stderr


def test_rendezvous_service_matches_the_template(train_template: dict) -> None:
    service = yaml.safe_load((WORK_POOLS_DIR / "gb200-train-service.yaml").read_text())
    props = train_template["variables"]["properties"]
    assert service["kind"] == "Service" and service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["metadata"]["name"] == props["rdzv_service"]["default"]
    assert service["metadata"]["namespace"] == props["namespace"]["default"]
    pod_labels = render(train_template, WORKER_VALUES)["job_manifest"]["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"] == pod_labels
    # The c10d store, and the launch node 0 serves to the others one port up (`torchrun.launch_address`).
    assert [p["port"] for p in service["spec"]["ports"]] == [29400, 29401] == [
        props["rdzv_port"]["default"], props["rdzv_port"]["default"] + 1,
    ]  # fmt: skip


def _train_env(template: dict) -> list[dict]:
    return _pod(template)["containers"][0]["env"]


def test_broken_gb200_train_copies_are_named(train_template: dict) -> None:
    broken = deepcopy(train_template)
    broken["job_configuration"]["job_manifest"]["spec"]["completions"] = 2
    _one_problem(broken, "spec.completions", "{{ nnodes }}")
    broken = deepcopy(train_template)
    del broken["job_configuration"]["job_manifest"]["spec"]["completionMode"]
    _one_problem(broken, "spec.completionMode", "Indexed")
    broken = deepcopy(train_template)
    del broken["job_configuration"]["job_manifest"]["spec"]["successPolicy"]
    _one_problem(broken, "spec.successPolicy")
    broken = deepcopy(train_template)
    del broken["variables"]["properties"]["nnodes"]["default"]
    _one_problem(broken, "variables.properties.nnodes", "default >= 1")
    broken = deepcopy(train_template)
    _pod(broken)["containers"][0]["env"] = [e for e in _train_env(broken) if e["name"] != "DRAFTSMITH_RDZV_ENDPOINT"]
    _one_problem(broken, "containers[0].env", "DRAFTSMITH_RDZV_ENDPOINT")
    broken = deepcopy(train_template)
    _pod(broken)["containers"][0]["command"] = ["/bin/sh", "-c", 'exec "$@"', "x"]
    _one_problem(broken, "containers[0].command", "index 0")


def test_env_values_kubernetes_would_reject_are_named(train_template: dict) -> None:
    broken = deepcopy(train_template)
    # A bare numeric placeholder renders to an int; Kubernetes wants a string.
    next(e for e in _train_env(broken) if e["name"] == "DRAFTSMITH_NNODES")["value"] = "{{ nnodes }}"
    _one_problem(broken, "env.DRAFTSMITH_NNODES", "renders to a int")
    broken = deepcopy(train_template)
    # $(VAR) only expands when VAR comes earlier in the list.
    env = _train_env(broken)
    env.append(env.pop(0))  # DRAFTSMITH_STR last
    problems = validate_base_job_template(broken)
    assert len(problems) == 2 and all("$(DRAFTSMITH_STR) is not defined earlier" in p for p in problems), problems
