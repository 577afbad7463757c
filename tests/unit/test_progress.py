"""The progress hook: throttled, thread-safe, a no-op outside a Prefect run; the UI's keys, names and summaries."""

import contextvars
import json
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from draftsmith.core import ui
from draftsmith.core.manifest import FileEntry, StageManifest
from draftsmith.core.progress import Progress, stage_progress
from draftsmith.drafters.export import serve

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_updates_are_throttled_and_the_final_100_always_goes():
    clock, sent = Clock(), list[Any]()
    p = Progress(1000, sent.append, min_interval_s=2.0, clock=clock)
    for i in range(1, 1000):  # one update per unit, 10 ms apart: about 10 s in all
        clock.t += 0.01
        p.update(i)
    # Created at 0 % counts as the first call: then one update per 2 s window, never more.
    assert len(sent) == 4, sent
    assert sent == sorted(sent) and all(0 < v < 100 for v in sent)
    p.finish()  # 0.01 s after the last update, inside the window: still sent
    assert sent[-1] == 100.0 and len(sent) == 5
    p.finish()
    assert len(sent) == 5, "an unchanged value is not sent again"


def test_unchanged_percentages_are_not_sent():
    clock, sent = Clock(), list[Any]()
    p = Progress(10_000, sent.append, clock=clock)
    for _ in range(5):
        clock.t += 10
        p.update(1)  # 0.01 % rounds to 0.0, what the artifact already shows
    assert sent == []
    clock.t += 10
    p.update(5000)
    assert sent == [50.0]


def test_unknown_total_shows_zero_until_set():
    clock, sent = Clock(), list[Any]()
    p = Progress(None, sent.append, clock=clock)
    clock.t += 5
    p.update(7)
    assert p.percent() == 0.0 and sent == []
    p.set_total(14)
    clock.t += 5
    p.update(7)
    assert sent == [50.0]
    with pytest.raises(ValueError, match="Progress.total"):
        p.set_total(-1)


def test_context_manager_finishes_on_success_only():
    sent: list[float] = []
    with Progress(4, sent.append, clock=Clock()) as p:
        p.advance(2)
    assert sent[-1] == 100.0
    failed: list[float] = []
    with pytest.raises(RuntimeError), Progress(4, failed.append, clock=Clock()) as p:
        p.advance(1)
        raise RuntimeError("stage failed")
    assert 100.0 not in failed


def test_empty_stage_is_done():
    sent: list[float] = []
    Progress(0, sent.append, clock=Clock()).finish()
    assert sent == [100.0]


def test_a_failing_sink_never_fails_the_stage(caplog):
    calls = []

    def broken(value: float) -> None:
        calls.append(value)
        raise ConnectionError("API down")

    clock = Clock()
    p = Progress(10, broken, clock=clock)
    clock.t += 3
    p.update(5)
    clock.t += 3
    p.update(6)
    p.finish()
    assert calls == [50.0] and not p.enabled
    assert "no further updates" in caplog.text


def test_outside_a_prefect_run_nothing_is_called(monkeypatch):
    from prefect import artifacts

    def refuse(*a, **k):
        raise AssertionError("a Prefect API call outside a run")

    monkeypatch.setattr(artifacts, "create_progress_artifact", refuse)
    monkeypatch.setattr(artifacts, "update_progress_artifact", refuse)
    p = stage_progress("regenerate", "/runs/tiny-cpu/regenerate", 10, "prompts answered", unit="prompt")
    assert not p.enabled
    p.advance(5)
    p.finish()
    assert p.percent() == 100.0


def test_updates_from_another_thread_run_in_the_creating_context(monkeypatch):
    """Training reports from torchrun's reader thread: the API calls must still see the run's context."""
    from prefect import artifacts

    marker: contextvars.ContextVar[str] = contextvars.ContextVar("marker", default="none")
    seen: list[tuple[str, str, float]] = []
    monkeypatch.setattr(ui, "in_prefect_run", lambda: True)
    monkeypatch.setattr(artifacts, "create_progress_artifact", lambda progress, key, description: f"id-{key}")
    monkeypatch.setattr(artifacts, "update_progress_artifact", lambda aid, pct: seen.append((marker.get(), aid, pct)))
    marker.set("task-run")
    p = stage_progress("train", "/runs/Tiny_CPU/train", 4, "optimizer steps", unit="step")

    def work() -> None:
        p.update(2)
        p.finish()

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    # 50 % came within 2 s of the creation, so only the final 100 % went out; from the run's context.
    assert seen == [("task-run", "id-tiny-cpu-train-progress", 100.0)]


@pytest.mark.parametrize(
    ("parts", "key"),
    [
        (("tiny-cpu", "select_prompts", "summary"), "tiny-cpu-select-prompts-summary"),
        (("Kimi K3/dspark", "train"), "kimi-k3-dspark-train"),
        (("--a--", "", "B"), "a-b"),
    ],
)
def test_artifact_keys_are_valid_prefect_keys(parts, key):
    assert ui.artifact_key(*parts) == key


def test_artifact_key_needs_a_letter():
    with pytest.raises(ValueError, match="artifact key"):
        ui.artifact_key("--", "_")


def test_task_run_names_say_which_run():
    namer = ui.task_run_namer("regenerate")
    assert namer(parameters={"run_dir": "s3://bucket/runs/smollm2-cpu-eagle3/"}) == "regenerate[smollm2-cpu-eagle3]"
    assert namer(parameters={"run_dir": ""}) == "regenerate"
    assert ui.run_label("/runs/tiny/train", parent=True) == "tiny"


def _manifest(created_at: datetime) -> StageManifest:
    return StageManifest(
        stage="regenerate",
        key="ab" * 32,
        uri="/runs/tiny-cpu/regenerate",
        files=[FileEntry(name=f"conversations-{i:05d}.jsonl", bytes=1536 * (i + 1), digest="0") for i in range(7)],
        counts={"prompts": 18, "conversations": 15, "dropped.empty_answer": 2, "dropped.truncated": 1},
        metrics={"bytes_per_token": 12.5},
        info={"engine": "hf", "sampling": json.dumps({"temperature": 0.7, "note": "a|b"})},
        seconds=69.4,
        created_at=created_at.isoformat(),
    )


def test_summary_shows_counts_rejects_sizes_and_time():
    now = datetime.now(UTC)
    md = ui.summary_markdown(_manifest(now), started_at=now - timedelta(seconds=70))
    assert md.startswith("# regenerate · tiny-cpu")
    assert "Computed in 69.4 s." in md
    assert "**7 files, 42.0 KiB**" in md  # 1.5 KiB * (1 + ... + 7)
    assert "**3 rows dropped or rejected**" in md
    assert "| conversations | 15 |" in md and "| bytes_per_token | 12.5 |" in md
    assert md.count("| `conversations-") == 5, "only the five largest files are listed"
    assert "| `conversations-00006.jsonl` | 10.5 KiB |" in md
    assert "a\\|b" in md, "a pipe inside a value would break the table"


def test_summary_says_when_a_stage_was_reused():
    then = datetime.now(UTC) - timedelta(hours=1)
    md = ui.summary_markdown(_manifest(then), started_at=datetime.now(UTC))
    assert f"Up to date: reused the result computed at {then.isoformat()} in 69.4 s." in md


def test_publishers_are_no_ops_outside_a_run():
    now = datetime.now(UTC)
    assert ui.publish_summary(_manifest(now), started_at=now) is None
    assert serve.publish_checkpoint(_manifest(now), target_source="org/model", depth=3) == []


def test_human_bytes():
    assert [ui.human_bytes(n) for n in (0, 1023, 1024, 5 * 2**30, 3 * 2**40)] == [
        "0 B",
        "1023 B",
        "1.0 KiB",
        "5.0 GiB",
        "3.0 TiB",
    ]


def test_serve_snippet_is_the_export_and_vllm_commands(tmp_path):
    train = tmp_path / "kimi-k3-dflash2" / "train"
    train.mkdir(parents=True)
    (train / "config.json").write_text(json.dumps({"block_size": 8}))
    manifest = StageManifest(stage="train", key="k" * 64, uri=str(train), info={"drafter": "dflash2"})
    md = serve.serve_markdown(manifest, target_source="moonshotai/Kimi-K3", depth=None, platform="gpu")
    export = tmp_path.resolve() / "kimi-k3-dflash2" / "export" / "vllm"
    assert f"draftsmith export {tmp_path / 'kimi-k3-dflash2'} --engine vllm --platform gpu" in md
    spec = json.dumps({"method": "dflash", "model": str(export), "num_speculative_tokens": 7})
    assert f"vllm serve moonshotai/Kimi-K3 --host 127.0.0.1 --speculative-config '{spec}'" in md, md
    cpu = serve.serve_markdown(manifest, target_source="moonshotai/Kimi-K3", depth=None, platform="cpu")
    assert "-m vllm.entrypoints.openai.api_server --model moonshotai/Kimi-K3 --dtype float32" in cpu, cpu
    assert "vllm serve" not in cpu and "--platform cpu" in cpu and "--enforce-eager" not in cpu
    # A run whose recipe measured its speed-up eager is served eager, as `draftsmith export` prints it.
    recipe = Path(__file__).resolve().parents[2] / "deployments" / "recipes" / "tiny-cpu.yaml"
    (tmp_path / "kimi-k3-dflash2" / "recipe.yaml").write_text(recipe.read_text() + "\nspeedup: {compile: false}\n")
    eager = serve.serve_markdown(manifest, target_source="moonshotai/Kimi-K3", depth=None, platform="cpu")
    assert eager.replace(" --enforce-eager", "") == cpu and "--enforce-eager" in eager
    (train / "config.json").write_text("{}")
    with pytest.raises(KeyError, match="block_size"):
        serve.serve_markdown(manifest, target_source="moonshotai/Kimi-K3", depth=None)
