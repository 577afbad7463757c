"""The terminal sink of `Progress`: a tqdm bar on a TTY, nothing at all elsewhere, log lines kept off the bar."""

import io
import logging
import os
import re
import sys
import time
from typing import Any, cast

import pytest

from draftsmith.core import progress as progress_mod
from draftsmith.core.progress import MODE_ENV, Progress, stage_progress
from draftsmith.drafters.speculative import GREEDY
from draftsmith.evals import harness
from draftsmith.evals.records import BenchPrompt
from draftsmith.tasks import prompt_filters, prompt_pool
from draftsmith.tasks.train import StepProgress

pytestmark = pytest.mark.unit
# tqdm redraws at most every 0.1 s: a pause longer than that makes the next update draw.
REDRAW_S = 0.12


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture(autouse=True)
def _auto_mode(monkeypatch):
    """Every test starts in the default mode, outside a torchrun rank, whatever the shell running it says."""
    monkeypatch.delenv(MODE_ENV, raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)


def _run(p: Progress, steps: list[float]) -> None:
    for done in steps:
        p.update(done)
        time.sleep(REDRAW_S)
    p.finish()


def test_a_tty_gets_a_bar_with_counts_unit_rate_and_eta():
    tty = FakeTTY()
    p = Progress(10, desc="regenerate", unit="prompt", stream=tty)
    assert tty.getvalue() == "", "the bar opens at the first update, not before"
    _run(p, [0, 3, 4])
    out = tty.getvalue()
    assert "regenerate:" in out
    assert re.search(r"40%\|.*\| 4/10 \[00:0\d<00:0\d, +\d+\.\d\dprompt/s\]", out), out
    assert re.search(r"100%\|.*\| 10/10 \[", out) and out.endswith("\n"), "finish draws 100 % and ends the line"
    assert "3.0/10" not in out, "whole counts read as ints"
    tty.truncate(0)
    p.update(11)
    p.finish()
    assert tty.getvalue() == "", "a finished bar stays closed"


def test_unknown_total_counts_up_then_shows_the_total_once_known():
    tty = FakeTTY()
    p = Progress(None, desc="train", unit="step", stream=tty)
    p.update(5)
    assert "5step [" in tty.getvalue()
    p.set_total(20)
    assert re.search(r"25%\|.*\| 5/20 \[", tty.getvalue())
    p.finish()


def test_a_resumed_stage_starts_the_bar_at_what_was_done():
    tty = FakeTTY()
    p = Progress(80, desc="train", unit="step", stream=tty)
    p.update(20)
    assert re.search(r"25%\|.*\| 20/80 \[00:00<\?, \?step/s\]", tty.getvalue()), "no rate from the resumed work"
    p.finish()


def test_a_note_follows_the_rate():
    tty = FakeTTY()
    p = Progress(4, desc="train", unit="step", stream=tty)
    p.update(1)
    p.note("loss 2.5")
    time.sleep(REDRAW_S)
    p.update(2)
    p.finish()
    assert re.search(r"2/4 \[.*step/s, loss 2\.5\]", tty.getvalue()), tty.getvalue()


def test_no_tty_no_output_at_all(capsys):
    plain = io.StringIO()
    p = Progress(10, desc="regenerate", unit="prompt", stream=plain)
    p.note("x")
    _run(p, [0, 5])
    assert plain.getvalue() == ""
    default = Progress(10, desc="hidden_states", unit="sample")  # stderr, captured by pytest: not a TTY
    _run(default, [0, 5])
    assert capsys.readouterr() == ("", "")


@pytest.mark.parametrize(
    ("mode", "stream", "shown"),
    [
        ("never", FakeTTY, False),
        ("always", io.StringIO, True),
        ("auto", io.StringIO, False),
        ("auto", FakeTTY, True),
        (" ALWAYS ", io.StringIO, True),
    ],
)
def test_the_environment_overrides_the_tty_check(monkeypatch, mode, stream, shown):
    monkeypatch.setenv(MODE_ENV, mode)
    out = stream()
    _run(Progress(3, desc="tokenize", unit="shard", stream=out), [1])
    assert ("3/3" in out.getvalue()) is shown


def test_an_unknown_mode_is_auto_with_a_warning(monkeypatch, caplog):
    monkeypatch.setenv(MODE_ENV, "sometimes")
    monkeypatch.setattr(progress_mod, "_warned_modes", set())
    plain, tty = io.StringIO(), FakeTTY()
    _run(Progress(2, desc="a", unit="x", stream=plain), [1])
    _run(Progress(2, desc="b", unit="x", stream=tty), [1])
    assert plain.getvalue() == "" and "2/2" in tty.getvalue()
    assert f"{MODE_ENV}='sometimes'" in caplog.text


def test_never_from_a_torchrun_rank(monkeypatch):
    """Ranks' output is piped to the launcher, which follows the log and draws the bar itself."""
    monkeypatch.setenv(MODE_ENV, "always")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "draftsmith-abc")
    tty = FakeTTY()
    _run(Progress(3, desc="train", unit="step", stream=tty), [1, 2])
    assert tty.getvalue() == ""


def test_the_prefect_sink_stays_throttled_while_the_bar_draws():
    clock, sent, tty = Clock(), list[Any](), FakeTTY()
    p = Progress(1000, sent.append, desc="hidden_states", unit="sample", stream=tty, clock=clock)
    for i in range(1, 1000):  # one update per unit, 10 ms apart on the sink's clock: about 10 s in all
        clock.t += 0.01
        p.update(i)
    assert len(sent) == 4 and all(0 < v < 100 for v in sent), sent
    p.finish()
    assert sent[-1] == 100.0 and len(sent) == 5
    assert "1000/1000" in tty.getvalue()


def test_stage_progress_names_the_bar_after_the_stage(monkeypatch):
    monkeypatch.setenv(MODE_ENV, "always")
    monkeypatch.setattr(sys, "stderr", FakeTTY())
    p = stage_progress("hidden_states", "/runs/tiny-cpu/hidden_states", 4, "samples captured", unit="sample")
    assert not p.enabled, "no Prefect run here"
    _run(p, [1])
    assert re.search(r"hidden_states: 100%\|.*\| 4/4 \[.*sample/s\]", cast(io.StringIO, sys.stderr).getvalue())


def test_log_lines_go_above_an_open_bar_and_the_handlers_come_back():
    tty = FakeTTY()
    handler = logging.StreamHandler(tty)
    handler.setFormatter(logging.Formatter("LOG %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        p = Progress(10, desc="train", unit="step", stream=tty)
        p.update(3)
        assert handler not in root.handlers, "while the bar is open, the console handler writes around it"
        logging.getLogger("draftsmith.test").warning("rank0: train step 3 | loss 2.5")
        p.finish()
        assert handler in root.handlers
        logging.getLogger("draftsmith.test").warning("after")
    finally:
        root.removeHandler(handler)
    before, line, after = tty.getvalue().partition("LOG rank0: train step 3 | loss 2.5\n")
    assert line, tty.getvalue()
    assert re.search(r"\r +\r$", before), "the bar is wiped before the line is written"
    assert after.startswith("\rtrain:  30%"), "and drawn again below it"
    assert after.endswith("LOG after\n")


def test_a_failed_stage_closes_its_bar_where_it_stood():
    tty = FakeTTY()
    handler = logging.StreamHandler(tty)
    logging.getLogger().addHandler(handler)
    try:
        with pytest.raises(RuntimeError), Progress(10, desc="evaluate", unit="prompt", stream=tty) as p:
            p.update(4)
            raise RuntimeError("stage failed")
        assert handler in logging.getLogger().handlers
    finally:
        logging.getLogger().removeHandler(handler)
    out = tty.getvalue()
    assert "4/10" in out and "100%" not in out and out.endswith("\n")


def test_a_broken_terminal_never_fails_the_stage():
    tty = FakeTTY()
    p = Progress(10, desc="regenerate", unit="prompt", stream=tty)
    p.update(1)
    tty.close()
    time.sleep(REDRAW_S)
    p.update(2)
    p.note("x")
    p.finish()
    assert p.done == 10 and p.percent() == 100.0


def test_training_steps_and_loss_reach_the_bar():
    tty = FakeTTY()
    p = Progress(None, desc="train", unit="step", stream=tty)
    tracker = StepProgress(logging.getLogger("draftsmith.test.train"), p, max_steps=None)
    tracker.info("[rank0]:... train: rank 0 of 2, 40 steps, resuming at step 0")
    time.sleep(REDRAW_S)
    tracker.info("[rank0]:... INFO draftsmith.drafters.training.metrics: train step 10 | loss 3.25 acc_0 0.31")
    p.finish()
    assert re.search(r"25%\|.*\| 10/40 \[.*step/s, loss 3\.25\]", tty.getvalue()), tty.getvalue()


def test_evaluation_reports_every_batch_of_prompts(monkeypatch):
    """`draftsmith eval` reported once per benchmark; now once per batch of prompts decoded."""
    monkeypatch.setattr(harness, "_run_group", lambda target, tok, decoder, group, s, eos: [])
    settings = harness.EvalSettings(sampling=GREEDY, rule="greedy", max_new_tokens=4, g=3, batch_size=2)
    prompts = [BenchPrompt(f"p{i}", "chat", ["hi"], None, "b") for i in range(5)]
    calls: list[int] = []
    nothing: Any = None  # `_run_group` is replaced: no target, tokenizer or decoder is used
    harness.run_prompts(nothing, nothing, nothing, prompts, settings, set(), calls.append)
    assert calls == [2, 2, 1]


def test_near_dedupe_reports_every_batch_and_keeps_its_result(monkeypatch):
    records = prompt_pool.synthetic_pool(60, seed=3, mix=None)
    records += records[:10]  # exact repeats are near duplicates too
    whole = prompt_filters.near_dedupe(records, threshold=0.7, num_perm=64, shingle_size=3)
    monkeypatch.setattr(prompt_filters, "_DEDUPE_BATCH", 16)
    calls: list[int] = []
    batched = prompt_filters.near_dedupe(records, threshold=0.7, num_perm=64, shingle_size=3, done=calls.append)
    assert batched == whole and whole[1] >= 10
    assert calls == [16, 16, 16, 16, 6]


def test_the_sweep_driver_polls_while_it_waits(tmp_path):
    from draftsmith.evals.sweep_bench import run_driver

    polls: list[float] = []
    cmd = [sys.executable, "-c", "import time; time.sleep(0.6)"]
    run_driver(cmd, {}, tmp_path / "bench.log", 30, poll=lambda: polls.append(time.monotonic()), poll_s=0.05)
    assert len(polls) >= 3
    with pytest.raises(RuntimeError, match="ran past"):
        run_driver([sys.executable, "-c", "import time; time.sleep(30)"], {}, tmp_path / "bench.log", 0.3)


def test_bars_on_other_streams_leave_unrelated_handlers_alone():
    """A handler writing to a file or a buffer is not the screen: it is never wrapped."""
    buffer = logging.StreamHandler(io.StringIO())
    root = logging.getLogger()
    root.addHandler(buffer)
    try:
        p = Progress(2, desc="x", unit="y", stream=FakeTTY())
        p.update(1)
        assert buffer in root.handlers
        p.finish()
    finally:
        root.removeHandler(buffer)


def test_the_sweep_counts_levels_as_their_result_files_appear(monkeypatch, tmp_path):
    import functools

    from draftsmith.core.config.sweep import SweepConfig
    from draftsmith.evals import sweep, sweep_bench

    monkeypatch.setattr(sweep, "run_driver", functools.partial(sweep_bench.run_driver, poll_s=0.05))
    monkeypatch.setattr(sys, "stderr", FakeTTY())
    stale = tmp_path / "level-4.json"
    stale.write_text("{}")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))  # an earlier sweep's: not this one's progress
    script = (
        "import pathlib, sys, time\n"
        "for c in (1, 2):\n"
        "    time.sleep(0.3)\n"
        "    pathlib.Path(sys.argv[1], f'level-{c}.json').write_text('{}')\n"
        "time.sleep(0.3)"
    )
    cfg = SweepConfig(concurrency=(1, 2, 4), requests_per_level=4)
    sweep._drive([sys.executable, "-c", script, str(tmp_path)], {}, tmp_path / "bench.log", cfg, tmp_path, "sweep (x)")
    states = re.findall(r"sweep \(x\):\s+\d+%\|[^|]*\| (\d)/3 \[", cast(io.StringIO, sys.stderr).getvalue())
    assert states[:1] == ["0"] and "1" in states and "2" in states, states
    assert states[-1] == "3", "finish closes the bar at the total"
    assert states.index("2") > states.index("1")
