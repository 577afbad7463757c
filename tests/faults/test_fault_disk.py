"""A local run folder on a disk that fills up: a small tmpfs in a private mount namespace (`unshare`).

The stage fails with one line naming the file it could not write and saying there is no space left; it
leaves no temp file and no half-written artifact, only whole files a rerun may trust, and no manifest.
Once the space is freed, the rerun resumes and the stage folder is bitwise what a clean run writes.
"""

import pytest

from tests.support.faults.storage import MountUnavailable, disk_full

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def test_a_full_disk_fails_naming_the_file_and_the_rerun_after_freeing_matches_a_clean_run(tmp_path):
    try:
        r = disk_full(tmp_path)
    except MountUnavailable as err:
        pytest.skip(str(err))
    d = r.detail
    line = d["error"]
    assert d["error_type"] == "StorageError", d
    assert line and "\n" not in line, repr(line)
    assert line.startswith(d["stage_dir"] + "/") and ": write failed: no space left on device (" in line, line
    assert d["temps"] == [] and d["torn"] == [], d
    assert not d["manifest_after_failure"], d
    assert any(name.startswith("shard-") for name in d["whole_after_failure"]), "it failed part-way through"
    assert d["files_differ"] == [] and not d["manifest_differs"], d
    assert (r.lost, r.duplicated, r.corrupted) == (0, 0, 0), r
