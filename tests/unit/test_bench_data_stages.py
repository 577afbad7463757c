"""`benchmarks/helpers/data_stages.py`: the benchmarks run the data stages with the pipeline's arguments, so that
after `make run` they find its stages cached instead of recomputing them under other keys."""

import inspect

import pytest

from benchmarks.helpers import data_stages
from draftsmith.flows.stages import key_here
from draftsmith.tasks import select_prompts

pytestmark = pytest.mark.unit


def _recording(monkeypatch) -> dict[str, dict]:
    """Stand-ins for the four stage functions that record their keyword arguments and return a token."""
    real = data_stages.stage_functions()
    calls: dict[str, dict] = {}

    def recorder(stage: str):
        def call(*args, **kwargs):
            assert not args, f"{stage}: called positionally"
            inspect.signature(real[stage]).bind(**kwargs)  # the real function takes exactly these
            calls[stage] = kwargs
            return f"<{stage} manifest>"

        return call

    monkeypatch.setattr(data_stages, "stage_functions", lambda: {s: recorder(s) for s in real})
    return calls


def test_each_stage_gets_the_pipelines_arguments_and_its_upstream(tiny_cfg, monkeypatch):
    answer = select_prompts.DEFAULT_ANSWER_TOKENS + 7  # not the task's default: the select key holds it
    cfg = tiny_cfg.model_copy(update={"regenerate": tiny_cfg.regenerate.model_copy(update={"max_new_tokens": answer})})
    calls = _recording(monkeypatch)
    out = data_stages.run_data_stages(cfg, "runs/x")
    assert list(out) == list(data_stages.DATA_STAGES) == list(calls)
    assert {s: c["out_uri"] for s, c in calls.items()} == {s: f"runs/x/{s}" for s in calls}
    select = {k: v for k, v in calls["select_prompts"].items() if k != "out_uri"}
    assert select["answer_tokens"] == answer
    assert select_prompts.select_prompts_key(**select) == key_here(cfg, "select_prompts", {})
    assert calls["regenerate"]["prompts"] == "<select_prompts manifest>"
    assert calls["tokenize"]["conversations"] == "<regenerate manifest>"
    assert calls["hidden_states"]["tokens"] == "<tokenize manifest>"
    assert calls["hidden_states"]["cfg"] == cfg.hidden_states and calls["regenerate"]["cfg"] == cfg.regenerate


def test_a_benchmark_may_stop_early_and_names_a_bad_stage(tiny_cfg, monkeypatch):
    calls = _recording(monkeypatch)
    assert list(data_stages.run_data_stages(tiny_cfg, "runs/x", last="regenerate")) == ["select_prompts", "regenerate"]
    assert "tokenize" not in calls
    with pytest.raises(ValueError, match="last: 'train' is not one of"):
        data_stages.run_data_stages(tiny_cfg, "runs/x", last="train")
