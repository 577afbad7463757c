"""Prefect work pools: base job templates, their validation, and the GPU concurrency limit.

A stage's `resources.work_pool` names a Prefect work pool. Every pool keeps its base job template in
`deployments/work-pools/<pool>.json` (the shape `prefect work-pool create --base-job-template FILE`
accepts): Kubernetes templates for the GPU pools and the CPU pool, a process template for `local`. Each
GPU pool also gets a global concurrency limit named `gpu:<pool>` whose slots are GPUs, so GPU tasks can
`concurrency("gpu:<pool>", occupy=n)`. Credentials reach pods by reference only (an `envFrom` Secret).

Multi-node pools (gb200-train) run one Indexed Job per flow run: `nnodes` pods, pod 0 runs the flow and hosts the
torchrun rendezvous, the other pods only join it (see deployments/work-pools/README.md).
"""

import json
import re
from copy import deepcopy
from pathlib import Path
from typing import Any

from prefect.utilities.templating import PlaceholderType, apply_values, find_placeholders

from draftsmith.core.gpus import gpu_limit_name

WORK_POOLS_DIR = Path(__file__).resolve().parents[1] / "deployments" / "work-pools"
GPU_RESOURCE = "nvidia.com/gpu"
SHM_PATH = "/dev/shm"
# What the Prefect kubernetes worker insists on (its job-manifest validators reject anything else).
_WORKER_CONTAINER_NAME = "prefect-job"
_POD = "job_configuration.job_manifest.spec.template.spec"
_JOB = "job_configuration.job_manifest.spec"
# The variable a multi-node template sizes its Indexed Job with.
NODES_VARIABLE = "nnodes"
# Env a multi-node pod must carry, and what its value must reference (draftsmith.drafters.training.torchrun reads them).
_COMPLETION_INDEX_FIELD = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
_RDZV_ENV = "DRAFTSMITH_RDZV_ENDPOINT"
_ENV_REF = re.compile(r"(?<!\$)\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
# What a process worker fills per flow run; a template must leave these to it.
_PROCESS_FIELDS = ("command", "env", "working_dir")
# Env names that carry credentials (AWS_SECRET_ACCESS_KEY, HF_TOKEN, ...): never as template defaults.
_SECRET_NAME = re.compile(r"(^|_)(SECRET|TOKEN|PASSWORD|PASSWD|CREDENTIALS?|ACCESS_KEY)(_|$)", re.IGNORECASE)


def pool_template_path(name: str) -> Path:
    """`deployments/work-pools/<name>.json`, the base job template of work pool `name`."""
    return WORK_POOLS_DIR / f"{name}.json"


def load_base_job_template(name: str) -> dict[str, Any]:
    """Read the base job template of work pool `name`; raises naming the file when it is absent or not JSON."""
    path = pool_template_path(name)
    if not path.is_file():
        known = sorted(p.stem for p in WORK_POOLS_DIR.glob("*.json"))
        raise FileNotFoundError(f"work pool {name!r}: no base job template at {path} (templates exist for {known})")
    try:
        template = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"work pool {name!r}: {path} is not valid JSON: {exc}") from exc
    if not isinstance(template, dict):
        raise ValueError(f"work pool {name!r}: {path} must hold a JSON object, got {type(template).__name__}")
    return template


def variable_defaults(template: dict[str, Any]) -> dict[str, Any]:
    """The `default` of every variable that has a non-null one (what a worker starts from)."""
    props = template.get("variables", {}).get("properties", {})
    return {name: spec["default"] for name, spec in props.items() if spec.get("default") is not None}


def render(template: dict[str, Any], values: dict[str, Any] | None = None) -> dict[str, Any]:
    """The job configuration with variable defaults, overridden by `values`, substituted.

    Prefect's own `apply_values` does the substitution, so the result is what a worker builds before
    it adds the flow run's name, command and env. A field whose placeholder has no value is dropped.
    """
    merged = variable_defaults(template) | (values or {})
    return apply_values(deepcopy(template["job_configuration"]), merged, remove_notset=True)


def _placeholder_names(value: Any) -> set[str]:
    """Names of the plain `{{ name }}` placeholders in `value` (not `prefect.variables.*`, blocks or `$ENV`)."""
    return {p.name for p in find_placeholders(value) if p.type is PlaceholderType.STANDARD}


def _undeclared_placeholders(job_config: dict[str, Any], props: dict[str, Any]) -> list[str]:
    problems = []
    for key, value in job_config.items():
        for name in sorted(_placeholder_names(value) - props.keys()):
            problems.append(f"job_configuration.{key}: placeholder {{{{ {name} }}}} has no variables.properties.{name}")
    for name, spec in props.items():
        if not isinstance(spec, dict) or not spec.get("description"):
            problems.append(f"variables.properties.{name}: needs a description")
    return problems


def _single_placeholder(value: Any) -> str | None:
    """The variable name if `value` is exactly one `{{ name }}` placeholder, else None."""
    if not isinstance(value, str):
        return None
    found = [p for p in find_placeholders(value) if p.type is PlaceholderType.STANDARD]
    return found[0].name if len(found) == 1 and found[0].full_match == value else None


def _check_gpu_limit(container: dict[str, Any], props: dict[str, Any]) -> list[str]:
    where = f"{_POD}.containers[0].resources.limits.{GPU_RESOURCE}"
    limit = container.get("resources", {}).get("limits", {}).get(GPU_RESOURCE)
    if limit is None:
        return [f"{where}: missing; the pod would get no GPU"]
    name = _single_placeholder(limit)
    if name is None:
        return [f"{where}: {limit!r} must be a single {{{{ variable }}}} placeholder, not a fixed value"]
    spec = props.get(name, {})
    if spec.get("type") != "integer" or not isinstance(spec.get("default"), int) or spec["default"] < 1:
        return [f"variables.properties.{name}: the GPU count needs type integer and a default >= 1"]
    return []


def _check_shm(pod: dict[str, Any], container: dict[str, Any]) -> list[str]:
    mounts = [m for m in container.get("volumeMounts") or [] if m.get("mountPath") == SHM_PATH]
    if not mounts:
        return [f"{_POD}.containers[0].volumeMounts: nothing mounted at {SHM_PATH}"]
    volumes = {v.get("name"): v for v in pod.get("volumes") or [] if isinstance(v, dict)}
    volume = volumes.get(mounts[0].get("name"))
    if volume is None:
        return [f"{_POD}.volumes: no volume named {mounts[0].get('name')!r} for {SHM_PATH}"]
    if (volume.get("emptyDir") or {}).get("medium") != "Memory":
        return [f"{_POD}.volumes.{volume['name']}: {SHM_PATH} must be an emptyDir with medium Memory"]
    return []


def _check_manifest(job_config: dict[str, Any], props: dict[str, Any], gpu: bool) -> list[str]:
    manifest = job_config.get("job_manifest")
    if not isinstance(manifest, dict):
        return ["job_configuration.job_manifest: missing (a kubernetes pool needs a Job manifest)"]
    pod = manifest.get("spec", {}).get("template", {}).get("spec")
    containers = (pod or {}).get("containers")
    if not isinstance(pod, dict) or not isinstance(containers, list) or not containers:
        return [f"{_POD}.containers: missing"]
    problems = []
    if manifest.get("apiVersion") != "batch/v1" or manifest.get("kind") != "Job":
        problems.append("job_configuration.job_manifest: must be apiVersion batch/v1, kind Job")
    if pod.get("restartPolicy") != "Never":
        problems.append(f"{_POD}.restartPolicy: the kubernetes worker requires 'Never'")
    if containers[0].get("name") != _WORKER_CONTAINER_NAME:
        problems.append(f"{_POD}.containers[0].name: the kubernetes worker requires {_WORKER_CONTAINER_NAME!r}")
    if not pod.get("nodeSelector"):
        problems.append(f"{_POD}.nodeSelector: missing; pods must be pinned to their node class")
    problems += _check_shm(pod, containers[0]) + _check_secret_ref(containers[0], props)
    if not gpu:
        if GPU_RESOURCE in containers[0].get("resources", {}).get("limits", {}):
            problems.append(f"{_POD}.containers[0].resources.limits.{GPU_RESOURCE}: a CPU pool must not take GPUs")
        return problems
    return problems + _check_gpu_limit(containers[0], props)


def is_multi_node(template: dict[str, Any]) -> bool:
    """True for a template whose job runs several pods (it declares `nnodes` or sets a completion mode)."""
    job_spec = template.get("job_configuration", {}).get("job_manifest", {}).get("spec", {})
    props = template.get("variables", {}).get("properties", {})
    return NODES_VARIABLE in props or "completionMode" in job_spec or "parallelism" in job_spec


def _env_entries(container: dict[str, Any]) -> dict[str, dict[str, Any]] | None:
    env = container.get("env")
    if not isinstance(env, list):
        return None
    return {e["name"]: e for e in env if isinstance(e, dict) and "name" in e}


def _check_job_shape(job_spec: dict[str, Any], pod: dict[str, Any], props: dict[str, Any]) -> list[str]:
    spec = props.get(NODES_VARIABLE, {})
    if spec.get("type") != "integer" or not isinstance(spec.get("default"), int) or spec["default"] < 1:
        return [f"variables.properties.{NODES_VARIABLE}: a multi-node pool needs it, type integer, default >= 1"]
    problems = []
    if job_spec.get("completionMode") != "Indexed":
        problems.append(f"{_JOB}.completionMode: must be 'Indexed' (pods find their node rank by index)")
    for key in ("completions", "parallelism"):
        if _single_placeholder(job_spec.get(key)) != NODES_VARIABLE:
            problems.append(f"{_JOB}.{key}: {job_spec.get(key)!r} must be {{{{ {NODES_VARIABLE} }}}}")
    # Pod 0 runs the flow and the other pods follow it: the job is done when pod 0 is (the rest are stopped).
    if job_spec.get("successPolicy") != {"rules": [{"succeededIndexes": "0"}]}:
        problems.append(f"{_JOB}.successPolicy: must be {{'rules': [{{'succeededIndexes': '0'}}]}}")
    if _single_placeholder(pod.get("subdomain")) not in props:
        problems.append(f"{_POD}.subdomain: must be a {{{{ variable }}}} naming the headless rendezvous Service")
    return problems


def _check_rendezvous_env(container: dict[str, Any], gpu_var: str | None) -> list[str]:
    where = f"{_POD}.containers[0].env"
    env = _env_entries(container)
    if env is None:
        return [f"{where}: must be a list (the rendezvous variables use the downward API)"]
    wanted = {
        "DRAFTSMITH_NODE_RANK": lambda e: (
            (e.get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath") == _COMPLETION_INDEX_FIELD
        ),
        "DRAFTSMITH_NNODES": lambda e: NODES_VARIABLE in _placeholder_names(e.get("value")),
        "DRAFTSMITH_NPROC_PER_NODE": lambda e: gpu_var in _placeholder_names(e.get("value")),
        # Pod 0 of the job: Indexed Job pods are named `<job>-<index>` under the Service subdomain.
        _RDZV_ENV: lambda e: "-0." in str(e.get("value")) and ":" in str(e.get("value")),
    }
    problems = [
        f"{where}: {name} missing or wrong" for name, ok in wanted.items() if name not in env or not ok(env[name])
    ]
    if "JOB_COMPLETION_INDEX" not in " ".join(map(str, container.get("command") or [])):
        problems.append(f"{_POD}.containers[0].command: must send pods other than index 0 away from the flow run")
    return problems


def _check_multi_node(job_config: dict[str, Any], props: dict[str, Any]) -> list[str]:
    job_spec = job_config["job_manifest"]["spec"]
    pod = job_spec["template"]["spec"]
    container = pod["containers"][0]
    gpu_var = _single_placeholder(container.get("resources", {}).get("limits", {}).get(GPU_RESOURCE))
    return _check_job_shape(job_spec, pod, props) + _check_rendezvous_env(container, gpu_var)


def rendered_env_problems(job_config: dict[str, Any]) -> list[str]:
    """Env entries of a rendered job configuration Kubernetes would reject or leave unexpanded.

    Values must be strings, and a `$(NAME)` reference is only expanded when NAME is defined earlier in the list.
    """
    container = job_config["job_manifest"]["spec"]["template"]["spec"]["containers"][0]
    env = container.get("env")
    if not isinstance(env, list):
        return []
    problems, defined = [], set()
    for entry in env:
        where = f"{_POD}.containers[0].env.{entry.get('name')}"
        value = entry.get("value")
        if "value" in entry and not isinstance(value, str):
            problems.append(f"{where}: value {value!r} renders to a {type(value).__name__}, Kubernetes needs a string")
        for ref in _ENV_REF.findall(value if isinstance(value, str) else ""):
            if ref not in defined:
                problems.append(f"{where}: $({ref}) is not defined earlier in the list, Kubernetes leaves it as is")
        defined.add(entry.get("name"))
    return problems


def _parts(template: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]] | str:
    """`(job_configuration, variables.properties)`, or the problem when either is missing."""
    job_config, variables = template.get("job_configuration"), template.get("variables")
    if not isinstance(job_config, dict) or not isinstance(variables, dict):
        return "base job template: needs both a `job_configuration` and a `variables` object"
    props = variables.get("properties")
    if not isinstance(props, dict):
        return "variables.properties: missing"
    return job_config, props


def validate_base_job_template(template: dict[str, Any], *, gpu: bool = True) -> list[str]:
    """Problems with a kubernetes base job template, each naming its field; empty when valid.

    GPU templates (`gpu=True`) template the `nvidia.com/gpu` limit; CPU ones (`gpu=False`) must not take GPUs.
    Multi-node templates (see `is_multi_node`) are also checked for the Indexed Job sized by `nnodes`, the
    rendezvous env and the defaults rendering to strings where Kubernetes wants them.
    """
    parts = _parts(template)
    if isinstance(parts, str):
        return [parts]
    job_config, props = parts
    problems = _undeclared_placeholders(job_config, props) + _check_manifest(job_config, props, gpu)
    problems += _literal_secret_problems(props)
    if problems or not is_multi_node(template):
        return problems
    problems = _check_multi_node(job_config, props)
    return problems or rendered_env_problems(render(template, {"name": "check", "command": "true"}))


def validate_process_template(template: dict[str, Any]) -> list[str]:
    """Problems with a process work pool's base job template (the shape `ProcessWorker` fills); empty when valid."""
    parts = _parts(template)
    if isinstance(parts, str):
        return [parts]
    job_config, props = parts
    problems = _undeclared_placeholders(job_config, props) + _literal_secret_problems(props)
    for key in _PROCESS_FIELDS:
        if _single_placeholder(job_config.get(key)) != key:
            problems.append(f"job_configuration.{key}: must be {{{{ {key} }}}} (the process worker fills it)")
    return problems


def validate_pool_template(pool_type: str, template: dict[str, Any], *, gpu: bool) -> list[str]:
    """Problems with the template of a `process` or `kubernetes` pool (GPU or not); empty when valid."""
    if pool_type == "process":
        if gpu:
            return ["a process pool cannot hold GPUs: use a kubernetes pool for GPU stages"]
        return validate_process_template(template)
    if pool_type == "kubernetes":
        return validate_base_job_template(template, gpu=gpu)
    return [f"pool type {pool_type!r}: only 'process' and 'kubernetes' templates are kept here"]


def _check_secret_ref(container: dict[str, Any], props: dict[str, Any]) -> list[str]:
    """Credentials reach the pod by reference: an `envFrom` Secret whose name is a declared variable."""
    refs = [e.get("secretRef") for e in container.get("envFrom") or [] if isinstance(e, dict)]
    names = [_single_placeholder((r or {}).get("name")) for r in refs]
    if not any(name in props for name in names):
        return [f"{_POD}.containers[0].envFrom: needs a secretRef whose name is a {{{{ variable }}}}"]
    return []


def _literal_secret_problems(props: dict[str, Any]) -> list[str]:
    """Environment defaults that look like credentials: those belong in a Secret or a Prefect block."""
    env = (props.get("env") or {}).get("default") or {}
    return [
        f"variables.properties.env.default.{name}: looks like a credential; reference a Secret instead"
        for name in sorted(env)
        if _SECRET_NAME.search(name)
    ]


def gpu_count_default(template: dict[str, Any]) -> int:
    """Default GPUs per pod: the default of the variable templated into the `nvidia.com/gpu` limit."""
    container = template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"][0]
    name = _single_placeholder(container["resources"]["limits"][GPU_RESOURCE])
    return int(template["variables"]["properties"][name]["default"])


def nodes_default(template: dict[str, Any]) -> int:
    """Default pods (nodes) per flow run: the `nnodes` default of a multi-node template, else 1."""
    spec = template["variables"]["properties"].get(NODES_VARIABLE)
    return int(spec["default"]) if spec else 1


def gpu_pool_concurrency(template: dict[str, Any], gpus: int, gpus_per_run: int | None = None) -> int:
    """Flow runs a GPU pool holding `gpus` GPUs runs at once: `gpus // gpus_per_run`.

    `gpus_per_run` defaults to the template's gpu_count times its nodes (a 2-node run of 4-GPU pods counts 8).
    """
    if gpus_per_run is None:
        gpus_per_run = gpu_count_default(template) * nodes_default(template)
    if gpus_per_run < 1 or gpus < gpus_per_run or gpus % gpus_per_run:
        raise ValueError(f"gpus ({gpus}) must be a positive multiple of gpus_per_run ({gpus_per_run})")
    return gpus // gpus_per_run


def gpu_limit_commands(pool: str, gpus: int, *, gpus_per_run: int | None = None) -> list[list[str]]:
    """The Prefect CLI commands that set up GPU pool `pool` holding `gpus` GPUs in all.

    1. create the kubernetes work pool from `deployments/work-pools/<pool>.json` (it fails with
       "already exists" on a second call: the caller decides whether that is fine);
    2. cap the pool's concurrent flow runs at `gpus // gpus_per_run` (default: the template's gpu_count
       times its nodes, so a 2-node run of 4-GPU pods counts 8);
    3. create the global concurrency limit `gpu:<pool>` with `gpus` slots, one per GPU.
    """
    template = load_base_job_template(pool)
    problems = validate_base_job_template(template)
    if problems:
        raise ValueError(f"work pool {pool!r}: invalid base job template:\n  " + "\n  ".join(problems))
    return [
        ["prefect", "work-pool", "create", pool, "--type", "kubernetes"]
        + ["--base-job-template", str(pool_template_path(pool))],
        [
            "prefect",
            "work-pool",
            "set-concurrency-limit",
            pool,
            str(gpu_pool_concurrency(template, gpus, gpus_per_run)),
        ],
        ["prefect", "gcl", "create", gpu_limit_name(pool), "--limit", str(gpus)],
    ]
