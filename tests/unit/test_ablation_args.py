"""`benchmarks.ablation --variant`: pairs split on commas, except inside a YAML list or mapping."""

import pytest

from benchmarks import ablation

pytestmark = pytest.mark.unit


def _variants(*argv: str) -> dict[str, dict]:
    return ablation.variants(ablation.parse_args(["--family", "eagle3", *argv]))


def test_a_list_value_keeps_its_commas():
    got = _variants(
        "--only",
        "taps",
        "--variant",
        "taps:hidden_states.taps=[2, 15,29],drafter.init_layer_from_target=29,x.y={a: 1, b: 2}",
    )
    assert got == {
        "taps": {"hidden_states.taps": [2, 15, 29], "drafter.init_layer_from_target": 29, "x.y": {"a": 1, "b": 2}}
    }


def test_a_pair_without_a_value_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        _variants("--variant", "bad:train.lr=0.1,oops")
    assert e.value.code == 2 and "--variant bad: KEY=VALUE expected, got 'oops'" in capsys.readouterr().err
