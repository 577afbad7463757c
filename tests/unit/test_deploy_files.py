"""The committed prefect files and pool inventory: recipes inlined verbatim, parameters the server accepts, every
deployment on the pool its recipe names, the nightly schedule, and no credential anywhere in them."""

import json
import re

import pytest
import yaml
from prefect.utilities.callables import parameter_schema_from_entrypoint
from prefect.utilities.schema_tools import validate

from draftsmith.core.config import PipelineConfig, load_recipe
from draftsmith.deploy import INVENTORY, LOCAL_PREFECT_FILE, PREFECT_FILE, ROOT, load_inventory
from draftsmith.pools import WORK_POOLS_DIR, load_base_job_template, validate_pool_template

pytestmark = pytest.mark.unit
RECIPES = ROOT / "deployments" / "recipes"
FILES = {"cluster": PREFECT_FILE, "local": LOCAL_PREFECT_FILE}
PIPELINE = "flows/pipeline.py:kimi_k3"
HIDDEN = "flows/hidden_states.py:hidden_states_flow"
STAGE = "flows/stages.py:stage_flow"
NIGHTLY = "flows/nightly.py:nightly_regression"
# prefect deploy ignores keys it does not know; these are the ones it reads (prefect.cli.deploy._models).
DEPLOYMENT_KEYS = {
    "name", "description", "tags", "entrypoint", "work_pool", "parameters", "schedules", "concurrency_limit",
}  # fmt: skip


def _deployments(kind: str) -> list[dict]:
    return yaml.safe_load(FILES[kind].read_text())["deployments"]


def _full_names(kind: str) -> set[str]:
    flows = {PIPELINE: "kimi-k3", HIDDEN: "hidden-states", STAGE: "stage", NIGHTLY: None}
    return {
        f"{flows[d['entrypoint']]}/{d['name']}" if flows[d["entrypoint"]] else d["name"] for d in _deployments(kind)
    }


@pytest.mark.parametrize("kind", FILES)
def test_inlined_configs_are_their_recipes_verbatim(kind: str) -> None:
    """Each deployment's default `config` is a copy of the recipe it names; they must not drift."""
    checked = 0
    for dep in _deployments(kind):
        assert set(dep) <= DEPLOYMENT_KEYS, f"{dep['name']}: unknown keys {set(dep) - DEPLOYMENT_KEYS}"
        assert dep["entrypoint"] in {PIPELINE, HIDDEN, STAGE, NIGHTLY}, dep["name"]
        if dep["entrypoint"] in (NIGHTLY, STAGE):
            # The nightly runs on its flow's committed defaults; a stage run gets its parameters from its parent.
            assert "parameters" not in dep, dep["name"]
            continue
        params = PipelineConfig.model_validate(dep["parameters"]["config"])
        assert params == load_recipe(RECIPES / f"{params.name}.yaml"), dep["name"]
        checked += 1
    assert checked == 4 if kind == "local" else checked == 6


@pytest.mark.parametrize("kind", FILES)
def test_parameters_pass_the_servers_schema_check(kind: str) -> None:
    """What the server runs on `prefect deploy` (enforce_parameter_schema): YAML's bare `on` would fail here."""
    entrypoints = (PIPELINE, HIDDEN, STAGE)
    schemas = {e: parameter_schema_from_entrypoint(f"{ROOT}/{e}").model_dump_for_openapi() for e in entrypoints}
    for dep in _deployments(kind):
        if "parameters" in dep:
            validate(dep["parameters"], schemas[dep["entrypoint"]], raise_on_error=True, ignore_required=True)


def test_both_files_define_the_same_deployment_names() -> None:
    assert _full_names("cluster") >= {"kimi-k3/eagle3", "kimi-k3/dflash2", "kimi-k3/dspark", "nightly-regression"}
    assert _full_names("local") >= {"kimi-k3/eagle3", "kimi-k3/dflash2", "kimi-k3/dspark", "nightly-regression"}
    kimi = {d["name"]: d for d in _deployments("cluster") if d["entrypoint"] == PIPELINE}
    local = {d["name"]: d for d in _deployments("local") if d["entrypoint"] == PIPELINE}
    assert kimi.keys() == local.keys() == {"eagle3", "dflash2", "dspark"}
    for name, dep in kimi.items():
        assert dep["parameters"]["config"]["name"] == f"kimi-k3-{name}"
        assert local[name]["parameters"]["config"]["name"] == f"smollm2-cpu-{name}"


def test_cluster_deployments_sit_on_the_pools_their_recipes_name() -> None:
    """The pipeline runs on its CPU stages' pool, sized for the largest; every other stage's pool has a `stage`
    deployment to dispatch it to; the hidden-state stage alone sits on its own pool. The nightly runs on `cpu`."""
    stage_pools = {d["work_pool"]["name"] for d in _deployments("cluster") if d["entrypoint"] == STAGE}
    for dep in _deployments("cluster"):
        pool, job_vars = dep["work_pool"]["name"], dep["work_pool"]["job_variables"]
        if dep["entrypoint"] in (NIGHTLY, STAGE):
            continue
        cfg = PipelineConfig.model_validate(dep["parameters"]["config"])
        if dep["entrypoint"] == HIDDEN:
            assert pool == cfg.hidden_states.resources.work_pool, dep["name"]
            assert job_vars["gpu_count"] == cfg.hidden_states.resources.gpus, dep["name"]
            continue
        cpu_stages = [cfg.select.resources, cfg.tokenize.resources]
        assert {r.work_pool for r in cpu_stages} == {pool} == {"cpu"}, dep["name"]
        assert job_vars["cpu_request"] == str(max(r.cpus for r in cpu_stages)), dep["name"]
        assert job_vars["memory_request"] == f"{max(r.memory_gb for r in cpu_stages)}Gi", dep["name"]
        assert dep["concurrency_limit"] == 1, "two runs of one recipe would share its run folder"
        others = {getattr(cfg, s).resources.work_pool for s in ("regenerate", "hidden_states", "train", "evaluate")}
        assert others == {"gb200", "gb200-train"} and others <= stage_pools, dep["name"]
    nightly = [d for d in _deployments("cluster") if d["entrypoint"] == NIGHTLY]
    assert [d["work_pool"]["name"] for d in nightly] == ["cpu"]


def test_local_deployments_sit_on_the_local_pools() -> None:
    """The pipelines on `local`, their recipes all on `local` too; a `stage` deployment for each local pool."""
    stage_pools = set()
    for dep in _deployments("local"):
        pool = dep["work_pool"]["name"]
        if dep["entrypoint"] == STAGE:
            stage_pools.add(pool)
            continue
        assert pool == "local", dep["name"]
        if "parameters" in dep:
            cfg = PipelineConfig.model_validate(dep["parameters"]["config"])
            assert {cfg.select.resources.work_pool, cfg.train.resources.work_pool} == {"local"}
    assert stage_pools == {"local", "local-gpu"}


@pytest.mark.parametrize("kind", FILES)
def test_nightly_is_scheduled_from_the_definitions_anchor(kind: str) -> None:
    doc = yaml.safe_load(FILES[kind].read_text())
    [nightly] = [d for d in doc["deployments"] if d["name"] == "nightly-regression"]
    assert nightly["entrypoint"] == NIGHTLY
    assert nightly["schedules"] == [doc["definitions"]["schedules"]["nightly"]]
    assert nightly["schedules"][0] | {"cron": None} == {"cron": None, "timezone": "UTC", "active": True}
    assert len(nightly["schedules"][0]["cron"].split()) == 5


def test_cluster_results_go_to_the_block_deploy_creates() -> None:
    storage = load_inventory().result_storage
    assert storage is not None and storage.basepath.startswith("s3://")
    for dep in _deployments("cluster"):
        env = dep["work_pool"]["job_variables"]["env"]
        assert env["PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK"] == f"remote-file-system/{storage.block}", dep["name"]
        assert env["PREFECT_RESULTS_DEFAULT_SERIALIZER"] == "json", dep["name"]
    local_env = load_base_job_template("local")["variables"]["properties"]["env"]["default"]
    assert local_env["PREFECT_RESULTS_DEFAULT_SERIALIZER"] == "json"


# Credential values as their issuers shape them: AWS access key ids, Hugging Face tokens.
SECRET_VALUES = re.compile(r"\b(AKIA[0-9A-Z]{16}|hf_[A-Za-z0-9]{30,})\b")
SECRET_KEYS = re.compile(r"(^|_)(SECRET|TOKEN|PASSWORD|ACCESS_KEY|CREDENTIALS?)(_|$)", re.IGNORECASE)


def _secret_entries(node, where: str = "") -> list[str]:
    """Dotted paths of mapping entries named like a credential that hold a literal value."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            path = f"{where}.{key}" if where else str(key)
            if SECRET_KEYS.search(str(key)) and isinstance(value, str) and "{{" not in value:
                found.append(path)
            found += _secret_entries(value, path)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += _secret_entries(value, f"{where}[{i}]")
    return found


def test_no_credentials_in_manifests() -> None:
    """Credentials come from Secrets by reference or the environment, never from a committed file."""
    for path in [PREFECT_FILE, LOCAL_PREFECT_FILE, INVENTORY, *sorted(WORK_POOLS_DIR.glob("*.json"))]:
        text = path.read_text()
        assert not SECRET_VALUES.search(text), path
        assert _secret_entries(yaml.safe_load(text)) == [], path
    assert _secret_entries({"env": {"AWS_SECRET_ACCESS_KEY": "x" * 40, "TOKENIZERS_PARALLELISM": "false"}}) == [
        "env.AWS_SECRET_ACCESS_KEY"
    ]
    for pool in ["cpu", "gb200", "gb200-train"]:
        pod = load_base_job_template(pool)["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
        assert pod["containers"][0]["envFrom"] == [
            {"secretRef": {"name": "{{ credentials_secret }}", "optional": True}}
        ]


def test_every_pool_a_prefect_file_names_is_in_the_inventory_with_a_valid_template() -> None:
    inventory = load_inventory()
    for kind in FILES:
        for dep in _deployments(kind):
            spec = inventory.pools[dep["work_pool"]["name"]]
            template = load_base_job_template(dep["work_pool"]["name"])
            assert validate_pool_template(spec.type, template, gpu=spec.gpus > 0) == [], dep["name"]
    # Every template beside the inventory belongs to a pool in it.
    assert {p.stem for p in WORK_POOLS_DIR.glob("*.json")} == set(inventory.pools)
    assert json.loads((WORK_POOLS_DIR / "local.json").read_text())["job_configuration"]["working_dir"]
