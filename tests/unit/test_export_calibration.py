"""A DSpark export carries the evaluate stage's confidence calibration (`drafters.dspark.export.extra_files`)."""

import json
from types import SimpleNamespace
from typing import Any

import pytest

from draftsmith.drafters.confidence import Calibration, read_calibration
from draftsmith.drafters.dspark.export import extra_files
from draftsmith.drafters.export.guards import ExportError

pytestmark = pytest.mark.unit
MODEL: Any = SimpleNamespace(spec=SimpleNamespace(block_size=3))  # what the hook reads of the drafter
BLOBS = {"config.json": json.dumps({"architectures": ["Qwen3DSparkModel"], "draftsmith": {"taps": [1]}}).encode()}


def test_the_calibration_joins_config_and_folder(tmp_path):
    (tmp_path / "evaluate").mkdir()
    fitted = Calibration([1.5, 0.8, 2.0], threshold=0.4, ece_before=0.2, ece_after=0.05, n_records=30)
    (tmp_path / "evaluate" / "calibration.json").write_text(fitted.to_json())
    out = extra_files(BLOBS, str(tmp_path), MODEL)
    config = json.loads(out["config.json"])
    assert config["confidence_temperatures"] == [1.5, 0.8, 2.0]
    assert config["draftsmith"]["taps"] == [1] and config["draftsmith"]["calibration"]["threshold"] == 0.4
    calibration = read_calibration(config)
    assert calibration is not None and calibration.temperatures == [1.5, 0.8, 2.0]
    assert Calibration.from_json(out["calibration.json"]) == fitted


def test_no_calibration_leaves_the_export_alone_and_a_wrong_block_is_refused(tmp_path):
    assert extra_files(BLOBS, str(tmp_path), MODEL) == BLOBS
    (tmp_path / "evaluate").mkdir()
    (tmp_path / "evaluate" / "calibration.json").write_text(Calibration([1.0, 1.0]).to_json())
    with pytest.raises(ExportError, match="2 temperatures for a block of 3"):
        extra_files(BLOBS, str(tmp_path), MODEL)
