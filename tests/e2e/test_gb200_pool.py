"""The gb200 GPU pool for real: a Prefect server on loopback, `gpu_limit_commands("gb200", 4)` run through the
venv's `prefect` CLI, then the kubernetes work pool, its base job template and both concurrency limits read
back from the server, and the `gpu:gb200` limit exercised by Prefect's own `concurrency()`. The multi-node
gb200-train pool (an Indexed Job template) is registered the same way and read back unchanged.

No Kubernetes cluster and no `prefect-kubernetes` are needed: the server knows the kubernetes pool type
from its bundled worker metadata; only a kubernetes *worker* needs that package.
"""

import json
import subprocess
import time

import pytest

from draftsmith.config import Resources
from draftsmith.pools import gpu_limit_commands, gpu_limit_name, gpu_slots, load_base_job_template
from tests.e2e.prefect_server import PREFECT, ROOT, Server, get_json

pytestmark = pytest.mark.e2e


def _prefect(server: Server, argv: list[str]) -> subprocess.CompletedProcess:
    """Run a `prefect ...` command line with the venv's executable against `server`."""
    assert argv[0] == "prefect", argv
    return subprocess.run(
        [str(PREFECT), *argv[1:]], cwd=ROOT, env=server.env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.timeout(300)
def test_gpu_limit_commands_set_up_gb200_pool(prefect_server: Server) -> None:
    server = prefect_server
    t0 = time.monotonic()
    commands = gpu_limit_commands("gb200", 4)
    for argv in commands:
        res = _prefect(server, argv)
        assert res.returncode == 0, f"{' '.join(argv)} exited {res.returncode}:\n{res.stdout}{res.stderr}"
    print(f"{len(commands)} commands: {time.monotonic() - t0:.1f} s")

    pool = get_json(f"{server.api_url}/work_pools/gb200")
    assert pool["type"] == "kubernetes"
    assert pool["base_job_template"] == load_base_job_template("gb200")
    assert pool["concurrency_limit"] == 1  # one 4-GPU pod at a time on 4 GPUs

    res = _prefect(server, ["prefect", "gcl", "inspect", gpu_limit_name("gb200"), "--output", "json"])
    assert res.returncode == 0, res.stdout + res.stderr
    gcl = json.loads(res.stdout)
    assert (gcl["name"], gcl["limit"], gcl["active"], gcl["active_slots"]) == ("gpu:gb200", 4, True, 0)

    # Setting up twice is refused by name, not silently changed: the caller decides what "exists" means.
    res = _prefect(server, commands[0])
    assert res.returncode == 1 and "already exists" in res.stdout + res.stderr, res.stdout + res.stderr
    _occupy_gpus(server)
    _register_gb200_train(server)
    print(f"total after server start: {time.monotonic() - t0:.1f} s")


def _register_gb200_train(server: Server) -> None:
    """The server accepts the Indexed Job template as is: 8 GPUs hold one 2-node x 4-GPU run."""
    for argv in gpu_limit_commands("gb200-train", 8):
        res = _prefect(server, argv)
        assert res.returncode == 0, f"{' '.join(argv)} exited {res.returncode}:\n{res.stdout}{res.stderr}"
    pool = get_json(f"{server.api_url}/work_pools/gb200-train")
    assert pool["type"] == "kubernetes" and pool["concurrency_limit"] == 1
    assert pool["base_job_template"] == load_base_job_template("gb200-train")
    job = pool["base_job_template"]["job_configuration"]["job_manifest"]["spec"]
    assert (job["completionMode"], job["completions"], job["parallelism"]) == (
        "Indexed",
        "{{ nnodes }}",
        "{{ nnodes }}",
    )
    res = _prefect(server, ["prefect", "gcl", "inspect", gpu_limit_name("gb200-train"), "--output", "json"])
    assert res.returncode == 0 and json.loads(res.stdout)["limit"] == 8, res.stdout + res.stderr


def _occupy_gpus(server: Server) -> None:
    """A 4-GPU stage (`gpu_slots`, as the hidden-state stage holds them) takes every slot of `gpu:gb200`;
    a fifth GPU is then refused until it lets go."""
    from prefect.concurrency.sync import concurrency
    from prefect.settings import PREFECT_API_URL, temporary_settings

    name = gpu_limit_name("gb200")
    url = f"{server.api_url}/v2/concurrency_limits/{name}"
    with temporary_settings({PREFECT_API_URL: server.api_url}):
        with gpu_slots(Resources(work_pool="gb200", gpus=4)):
            assert get_json(url)["active_slots"] == 4
            with pytest.raises(TimeoutError):
                with concurrency(name, occupy=1, timeout_seconds=1, strict=True):
                    pass
        assert get_json(url)["active_slots"] == 0
