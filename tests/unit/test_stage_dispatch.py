"""Where each stage runs: here, or as a `stage/<pool>` flow run sized by the stage's resources; and the
run-folder inputs a dispatched stage accepts. The flow runs themselves are in tests/e2e/test_deployment.py."""

from types import SimpleNamespace
from typing import Any

import prefect.deployments
import pytest
from prefect.exceptions import ObjectNotFound

from draftsmith.core import storage
from draftsmith.core.config.stages import Resources
from draftsmith.core.manifest import StageManifest, file_entry
from draftsmith.flows import dispatch
from draftsmith.pools import load_base_job_template

pytestmark = pytest.mark.unit


def _declared(pool: str) -> dict:
    return load_base_job_template(pool)["variables"]["properties"]


def _finished(run_dir, stage: str, key: str) -> StageManifest:
    """A finished stage folder: one artifact and the manifest naming it."""
    uri = str(run_dir / stage)
    storage.makedirs(uri)
    storage.write_bytes(storage.join(uri, "rows.jsonl"), b"{}\n")
    manifest = StageManifest(stage=stage, key=key, uri=uri, files=[file_entry(uri, "rows.jsonl", b"{}\n")])
    storage.write_json(storage.join(uri, "manifest.json"), manifest.model_dump(mode="json"))
    return manifest


def _on(cfg, **pools: str):
    """`cfg` with `<stage>.resources.work_pool` set per keyword."""
    update = {
        stage: getattr(cfg, stage).model_copy(update={"resources": Resources(work_pool=pool)})
        for stage, pool in pools.items()
    }
    return cfg.model_copy(update=update)


def test_resources_become_the_job_variables_the_pool_declares() -> None:
    train = Resources(work_pool="gb200-train", gpus=4, nodes=2, cpus=64, memory_gb=800)
    assert dispatch.job_variables(train, _declared("gb200-train")) == {
        "gpu_count": 4, "nnodes": 2, "cpu_request": "64", "memory_request": "800Gi", "memory_limit": "800Gi",
    }  # fmt: skip
    # One node per gb200 job: the pool's template has no `nnodes` to set.
    assert "nnodes" not in dispatch.job_variables(Resources(work_pool="gb200", gpus=4, nodes=4), _declared("gb200"))
    assert dispatch.job_variables(Resources(cpus=32, memory_gb=128), _declared("cpu")) == {
        "cpu_request": "32", "memory_request": "128Gi", "memory_limit": "128Gi",
    }  # fmt: skip
    assert dispatch.job_variables(Resources(cpus=2), _declared("local-gpu")) == {}


def test_every_stage_runs_here_without_a_pool_or_on_its_own_pool(tiny_cfg, tmp_path, monkeypatch) -> None:
    ran: list[Any] = []
    sent: list[tuple] = []

    def remote(cfg, stage, run_dir, keys, key):
        sent.append((stage, keys, key))
        return "remote"

    monkeypatch.setattr(dispatch, "remote", remote)

    def key_of(cfg, stage, inputs):
        return f"key-of-{stage}-" + ",".join(m.key for m in inputs.values() if m is not None)

    def here(cfg, stage, run_dir, inputs):
        ran.append((stage, sorted(inputs)))
        return StageManifest(stage=stage, key=f"k-{stage}", uri=str(tmp_path / stage))

    cfg = _on(tiny_cfg, regenerate="gpu", train="gpu")
    for pool in (None, "local"):
        done: dict = {}
        for stage in dispatch.STAGES:
            done[stage] = dispatch.run_stage(cfg, stage, str(tmp_path), done, here, pool, key_of=key_of)
        assert [s for s, _ in ran] == (list(dispatch.STAGES) if pool is None else [
            "select_prompts", "tokenize", "hidden_states", "evaluate",
        ])  # fmt: skip
        ran.clear()
    # Dispatched with the keys of the inputs this run finished; evaluate got the remote train's manifest.
    assert sent == [
        ("regenerate", {"select_prompts": "k-select_prompts"}, "key-of-regenerate-k-select_prompts"),
        (
            "train",
            {"tokenize": "k-tokenize", "hidden_states": "k-hidden_states"},
            "key-of-train-k-tokenize,k-hidden_states",
        ),
    ]
    assert done["train"] == "remote" and done["evaluate"].stage == "evaluate"


def test_online_hidden_states_are_no_stage(tiny_cfg, tmp_path) -> None:
    cfg = tiny_cfg.model_copy(update={"hidden_states": tiny_cfg.hidden_states.model_copy(update={"mode": "online"})})
    never: Any = pytest.fail  # neither runs nor keys anything: online hidden states have no stage
    assert dispatch.run_stage(cfg, "hidden_states", str(tmp_path), {}, never, None, key_of=never) is None
    done = {"tokenize": StageManifest(stage="tokenize", key="t", uri="x"), "hidden_states": None}
    assert dispatch.upstream_keys("train", done) == {"tokenize": "t"}


def test_a_dispatched_stage_reads_its_inputs_only_as_finished(tiny_cfg, tmp_path) -> None:
    with pytest.raises(
        dispatch.DispatchError, match=r"stage train: its input tokenize is not finished under .*/tokenize"
    ):
        dispatch.finished_inputs(tiny_cfg, "train", str(tmp_path), {})
    tokens = _finished(tmp_path, "tokenize", "a" * 64)
    hidden = _finished(tmp_path, "hidden_states", "b" * 64)
    got = dispatch.finished_inputs(tiny_cfg, "train", str(tmp_path), {"tokenize": "a" * 64, "hidden_states": "b" * 64})
    assert got == {"tokenize": tokens, "hidden_states": hidden}
    with pytest.raises(
        dispatch.DispatchError, match=r"tokenize/manifest.json has key aaaaaaaaaaaa, but .* bbbbbbbbbbbb"
    ):
        dispatch.finished_inputs(tiny_cfg, "train", str(tmp_path), {"tokenize": "b" * 64})
    (tmp_path / "hidden_states" / "rows.jsonl").unlink()  # an artifact gone: not finished any more
    with pytest.raises(dispatch.DispatchError, match="its input hidden_states is not finished"):
        dispatch.finished_inputs(tiny_cfg, "train", str(tmp_path), {})


def test_remote_names_the_field_and_the_flow_run_when_it_cannot_finish(tiny_cfg, tmp_path, monkeypatch) -> None:
    cfg = _on(tiny_cfg, regenerate="gb200")
    monkeypatch.setattr(dispatch, "_declared_variables", _declared)
    calls = []

    def missing(name, **kwargs):
        calls.append((name, kwargs))
        raise ObjectNotFound(http_exc=Exception("404"))

    monkeypatch.setattr(prefect.deployments, "run_deployment", missing)
    with pytest.raises(dispatch.DispatchError, match=r"regenerate.resources.work_pool is 'gb200'.* 'stage/gb200'"):
        dispatch.remote(cfg, "regenerate", "runs/x", {"select_prompts": "k"}, "c" * 64)
    [(name, kwargs)] = calls
    assert kwargs["parameters"]["run_dir"] == str(tmp_path.cwd() / "runs" / "x")  # absolute for the other worker
    assert (
        kwargs["parameters"]["expected"] == {"select_prompts": "k"}
        and kwargs["flow_run_name"] == "regenerate[tiny-cpu]"
    )
    assert kwargs["job_variables"]["gpu_count"] == 0 and kwargs["parameters"]["config"]["name"] == "tiny-cpu"

    failed = SimpleNamespace(
        is_completed=lambda: False, is_final=lambda: True, name="Failed", message="CUDA out of memory"
    )
    run = SimpleNamespace(name="clever-fox", id="1234", state=failed)
    monkeypatch.setattr(prefect.deployments, "run_deployment", lambda name, **kw: run)
    with pytest.raises(
        dispatch.DispatchError, match="flow run clever-fox .* on pool gb200 ended Failed: CUDA out of memory"
    ):
        dispatch.remote(cfg, "regenerate", str(tmp_path), {}, "c" * 64)
    run.state = SimpleNamespace(is_completed=lambda: True, is_final=lambda: True, name="Completed", message=None)
    with pytest.raises(dispatch.DispatchError, match="completed, but .*/regenerate holds no finished manifest"):
        dispatch.remote(cfg, "regenerate", str(tmp_path), {}, "c" * 64)
    _finished(tmp_path, "regenerate", "e" * 64)  # what workers running other code would leave
    with pytest.raises(dispatch.DispatchError, match="finished with key eeeeeeeeeeee, but .* give cccccccccccc"):
        dispatch.remote(cfg, "regenerate", str(tmp_path), {}, "c" * 64)
    done = _finished(tmp_path, "regenerate", "c" * 64)
    assert dispatch.remote(cfg, "regenerate", str(tmp_path), {}, "c" * 64) == done


def test_a_current_stage_is_answered_from_the_run_folder(tiny_cfg, tmp_path, monkeypatch) -> None:
    """A rerun schedules no pod for a finished stage; another key, a lost or changed file do."""
    cfg = _on(tiny_cfg, train="gb200-train")
    monkeypatch.setattr(dispatch, "_declared_variables", _declared)
    started = []

    def run(name, **kwargs):
        started.append(kwargs["parameters"]["expected"])
        _finished(tmp_path, "train", keys[-1])
        return SimpleNamespace(
            name="run", id="42", state=SimpleNamespace(is_completed=lambda: True, is_final=lambda: True)
        )

    monkeypatch.setattr(prefect.deployments, "run_deployment", run)
    keys = ["d" * 64]
    first = dispatch.remote(cfg, "train", str(tmp_path), {"tokenize": "t1"}, keys[-1])
    assert dispatch.remote(cfg, "train", str(tmp_path), {"tokenize": "t1"}, keys[-1]) == first and len(started) == 1
    keys.append("f" * 64)  # another recipe, upstream or code: another key
    dispatch.remote(cfg, "train", str(tmp_path), {"tokenize": "t2"}, keys[-1])
    assert started == [{"tokenize": "t1"}, {"tokenize": "t2"}]
    dispatch.remote(cfg, "train", str(tmp_path), {"tokenize": "t2"}, keys[-1])
    assert len(started) == 2
    (tmp_path / "train" / "rows.jsonl").write_bytes(b"[]\n")  # same size, other content
    dispatch.remote(cfg, "train", str(tmp_path), {"tokenize": "t2"}, keys[-1])
    assert len(started) == 3
    (tmp_path / "train" / "rows.jsonl").unlink()
    dispatch.remote(cfg, "train", str(tmp_path), {"tokenize": "t2"}, keys[-1])
    assert len(started) == 4
