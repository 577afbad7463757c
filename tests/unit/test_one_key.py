"""The Prefect cache key of a stage task is the stage's own key, and exists only while its result is intact."""

import sys

import pytest

from draftsmith.core import storage
from draftsmith.core.caching import stage_task
from draftsmith.core.manifest import file_entry
from draftsmith.core.stage import StageResult, run_stage, stage_key

pytestmark = pytest.mark.unit


def toy_key(rows: int) -> str:
    return stage_key("toy", [sys.modules[__name__]], rows=rows)


@stage_task("toy", "toy", key=toy_key)
def toy_task(rows: int, run_dir: str):
    def compute(uri: str) -> StageResult:
        return StageResult(files=[file_entry(uri, "rows.txt", b"x\n" * rows)])

    return run_stage("toy", storage.join(run_dir, "toy"), toy_key(rows), compute)


def test_the_cache_key_is_the_stage_key_checked_against_the_files(tmp_path) -> None:
    run_dir = str(tmp_path)
    cache_key = lambda rows: toy_task.cache_key_fn(None, {"rows": rows, "run_dir": run_dir})  # noqa: E731
    assert toy_task.stage_key is toy_key
    assert cache_key(3) is None  # nothing finished yet: the task runs
    manifest = toy_task.fn(rows=3, run_dir=run_dir)
    assert manifest.key == toy_key(3) == (tmp_path / "toy" / ".stage-key").read_text()
    first = cache_key(3)
    assert first is not None and cache_key(3) == first
    assert cache_key(4) is None  # other inputs: another key, which the folder does not hold
    (tmp_path / "toy" / "rows.txt").write_bytes(b"x\ny\nx\n")  # same size, other bytes
    assert cache_key(3) is None
    again = toy_task.fn(rows=3, run_dir=run_dir)  # recomputed with the same content: a new materialisation
    assert again.files == manifest.files and again.created_at != manifest.created_at
    second = cache_key(3)
    assert second is not None and second != first  # a hit returns this manifest, not the replaced one
    assert cache_key(3) == second


def test_a_copied_run_folder_never_hits_the_original_folders_result(tmp_path, monkeypatch) -> None:
    import shutil

    original, copy = tmp_path / "a", tmp_path / "b"
    toy_task.fn(rows=3, run_dir=str(original))
    shutil.copytree(original, copy)
    key_of = lambda run_dir: toy_task.cache_key_fn(None, {"rows": 3, "run_dir": run_dir})  # noqa: E731
    assert (copy / "toy" / "manifest.json").read_bytes() == (original / "toy" / "manifest.json").read_bytes()
    # The same stage key and the same bytes, but another folder: a hit must not hand back a manifest bound to
    # the original, whose files the copy's later stages would then read.
    assert key_of(str(copy)) not in (None, key_of(str(original)))
    # The same folder named relatively or absolutely is one folder.
    monkeypatch.chdir(tmp_path)
    assert key_of("b") == key_of(str(copy))
