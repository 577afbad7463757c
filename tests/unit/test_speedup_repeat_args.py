"""`benchmarks.speedup_repeat`: its own flags anywhere before `--`, everything after it to `draftsmith speedup`."""

import pytest

from benchmarks import speedup_repeat

pytestmark = pytest.mark.unit


@pytest.fixture
def calls(monkeypatch, tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "manifest.json").write_text("{}")
    seen: list[tuple] = []

    def measure(run, flags, repeat):
        seen.append((run, flags, repeat))
        return [{"levels": [{"concurrency": 2, "server": "drafter-3", "speedup": 1.0 + i / 10}]} for i in range(repeat)]

    monkeypatch.setattr(speedup_repeat, "measure", measure)
    return tmp_path, seen


def test_repeat_after_the_run_and_flags_after_the_separator(calls, capsys):
    run, seen = calls
    speedup_repeat.main([str(run), "--repeat", "3", "--", "--concurrency", "2,4", "--free-methods", "none"])
    assert seen == [(run, ["--concurrency", "2,4", "--free-methods", "none"], 3)]
    out = capsys.readouterr().out
    assert "| 2 | drafter-3 | ×1.00, ×1.10, ×1.20 | 20.0% | no |" in out and "largest spread 20.0%" in out


def test_no_separator_passes_no_flags(calls):
    run, seen = calls
    speedup_repeat.main(["--repeat", "2", str(run)])
    assert seen == [(run, [], 2)]


def test_an_unknown_flag_before_the_separator_is_a_usage_error(calls):
    run, _ = calls
    with pytest.raises(SystemExit) as e:
        speedup_repeat.main([str(run), "--concurrency", "2"])
    assert e.value.code == 2
