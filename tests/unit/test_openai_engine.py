"""OpenAIEngine against a real HTTP server on 127.0.0.1: retries, errors, parsing, concurrency, secrets."""

import logging
import time
from collections.abc import Callable

import pytest
from pydantic import ValidationError

from draftsmith.core.config import RegenerateConfig, TargetConfig
from draftsmith.core.retry import is_transient
from draftsmith.engines.base import ChatRequest, SamplingParams, TargetEngine
from draftsmith.engines.factory import make_engine
from draftsmith.engines.openai_http import EngineRequestError, EngineUnavailableError, OpenAIEngine
from tests.support.openai_server import ChatServer, Request
from tests.support.openai_server import Reply as ChatReply

pytestmark = pytest.mark.unit

SECRET = "sk-test-secret-0123456789"
PARAMS = SamplingParams(max_tokens=32)
HELLO = [ChatRequest(messages=[{"role": "user", "content": "hello"}])]

# (status, headers, body, seconds to wait before answering)
Reply = tuple[int, dict[str, str], dict | str, float]


def ok(content: str = "hi", n: int = 1, **message) -> dict:
    choices = [
        {"index": i, "message": {"role": "assistant", "content": f"{content}{i}", **message}, "finish_reason": "stop"}
        for i in range(n)
    ]
    return {"choices": choices, "usage": {"prompt_tokens": 3, "completion_tokens": 5 * n}}


@pytest.fixture
def serve():
    """Start a `ChatServer` whose reply to the k-th request is `script(k, body)`."""
    servers: list[ChatServer] = []

    def start(script: Callable[[int, dict], Reply]) -> ChatServer:
        def respond(request: Request) -> ChatReply:
            status, headers, body, wait = script(request.index, request.body)
            return ChatReply(status, body, headers, wait)

        servers.append(ChatServer(respond))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def engine(server: ChatServer, **kw) -> OpenAIEngine:
    return OpenAIEngine(server.url, "target-model", **({"backoff_s": 0.01, "timeout_s": 5} | kw))


def test_429_then_503_then_ok_retries_and_honours_retry_after(serve, caplog):
    replies = [(429, {"Retry-After": "1"}, "slow down", 0), (503, {}, "overloaded", 0), (200, {}, ok(), 0)]
    server = serve(lambda k, body: replies[k])
    start = time.time()
    with caplog.at_level(logging.WARNING):
        [[c]] = engine(server).chat(HELLO, PARAMS)
    assert c.text == "hi0" and c.finish_reason == "stop" and c.num_tokens == 5
    assert len(server.requests) == 3
    times = [r.t for r in server.requests]
    assert times[1] - times[0] >= 0.95  # Retry-After: 1, far above the 0.01 s backoff
    assert time.time() - start < 5
    assert "HTTP 429" in caplog.text and "HTTP 503" in caplog.text


def test_backoff_grows_exponentially_with_jitter(serve):
    server = serve(lambda k, body: (503, {}, "busy", 0) if k < 3 else (200, {}, ok(), 0))
    engine(server, backoff_s=0.1).chat(HELLO, PARAMS)
    t = [r.t for r in server.requests]
    gaps = [b - a for a, b in zip(t, t[1:], strict=False)]
    # Delays are backoff * 2**attempt * [0.5, 1.5): 0.05-0.15, 0.1-0.3, 0.2-0.6 s.
    assert 0.05 <= gaps[0] < 0.35 and 0.1 <= gaps[1] < 0.5 and 0.2 <= gaps[2] < 0.8


def test_400_is_not_retried_and_names_status_and_body(serve):
    server = serve(lambda k, body: (400, {}, '{"error": "unknown field thinking_effort"}', 0))
    with pytest.raises(EngineRequestError, match=r"HTTP 400.*unknown field thinking_effort") as err:
        engine(server, api_key=SECRET).chat(HELLO, PARAMS)
    assert len(server.requests) == 1
    assert SECRET not in str(err.value) and not is_transient(err.value)


def test_timeout_is_retried(serve):
    server = serve(lambda k, body: (200, {}, ok("late"), 1.0) if k == 0 else (200, {}, ok("fast"), 0))
    [[c]] = engine(server, timeout_s=0.3).chat(HELLO, PARAMS)
    assert c.text == "fast0" and len(server.requests) == 2


def test_exhausted_retries_raise_a_transient_error(serve):
    server = serve(lambda k, body: (502, {}, "bad gateway", 0))
    with pytest.raises(EngineUnavailableError, match=r"failing after 2 retries; last: HTTP 502: bad gateway") as err:
        engine(server, max_retries=2).chat(HELLO, PARAMS)
    assert len(server.requests) == 3
    assert isinstance(err.value, ConnectionError) and is_transient(err.value)  # the stage task may retry


def test_connection_refused_is_retried_then_fails():
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    eng = OpenAIEngine(f"http://127.0.0.1:{port}/v1", "m", max_retries=1, backoff_s=0.01)
    with pytest.raises(EngineUnavailableError, match="ConnectError"):
        eng.chat(HELLO, PARAMS)


def test_reasoning_tool_calls_finish_reasons_and_n(serve):
    call = [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]

    def script(k: int, body: dict) -> Reply:
        data = ok("ans", n=body["n"], reasoning_content="think hard")
        data["choices"][1]["finish_reason"] = "length"
        data["choices"][2]["message"] = {"role": "assistant", "content": None, "tool_calls": call}
        data["choices"][2]["finish_reason"] = "tool_calls"
        data["choices"][0]["message"] = {"role": "assistant", "content": " a ", "reasoning": "other field"}
        data["usage"]["completion_tokens"] = 10  # 4, 3, 3 across three choices
        return 200, {}, data, 0

    server = serve(script)
    [outs] = engine(server).chat(HELLO, SamplingParams(max_tokens=8, n=3))
    assert [c.text for c in outs] == ["a", "ans1", ""]
    assert [c.reasoning for c in outs] == ["other field", "think hard", None]
    assert [c.finish_reason for c in outs] == ["stop", "length", "stop"]
    assert outs[2].tool_calls == call and outs[0].tool_calls is None
    assert [c.num_tokens for c in outs] == [4, 3, 3]


def test_wrong_number_of_choices_is_an_error(serve):
    server = serve(lambda k, body: (200, {}, ok(n=1), 0))
    with pytest.raises(EngineRequestError, match="asked for n=2 choices, the server returned 1"):
        engine(server).chat(HELLO, SamplingParams(max_tokens=8, n=2))


def test_sampling_fields_tools_and_extra_body_reach_the_server(serve):
    server = serve(lambda k, body: (200, {}, ok(), 0))
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    history = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "hidden"},
        {"role": "user", "content": "q2"},
    ]
    extra = {"thinking": True, "thinking_effort": "max", "chat_template_kwargs": {"enable_thinking": True}}
    params = SamplingParams(max_tokens=77, temperature=0.6, top_p=0.9, seed=11, extra_body=extra)
    engine(server).chat([ChatRequest(messages=history, tools=tools)], params)
    body = server.requests[0].body
    assert {k: body[k] for k in ("model", "temperature", "top_p", "max_tokens", "n", "seed")} == {
        "model": "target-model",
        "temperature": 0.6,
        "top_p": 0.9,
        "max_tokens": 77,
        "n": 1,
        "seed": 11,
    }
    assert body["tools"] == tools and all(body[k] == v for k, v in extra.items())
    assert body["messages"][1] == {"role": "assistant", "content": "a1"}  # past reasoning is not sent back


def test_concurrency_limit_is_respected_and_order_kept(serve):
    server = serve(lambda k, body: (200, {}, ok(body["messages"][0]["content"]), 0.1))
    requests = [ChatRequest(messages=[{"role": "user", "content": f"q{i}-"}]) for i in range(12)]
    outs = engine(server, concurrency=3).chat(requests, PARAMS)
    assert [o[0].text for o in outs] == [f"q{i}-0" for i in range(12)]
    assert server.max_in_flight == 3


def test_api_key_is_a_bearer_token_and_never_described_or_logged(serve, caplog):
    server = serve(lambda k, body: (503, {}, "busy", 0) if k == 0 else (200, {}, ok(), 0))
    with pytest.raises(ValueError, match="must not carry credentials"):
        OpenAIEngine(server.url.replace("http://", "http://user:pw@"), "target-model")
    eng = OpenAIEngine(server.url, "target-model", api_key=SECRET, backoff_s=0.01)
    with caplog.at_level(logging.DEBUG):
        eng.chat(HELLO, PARAMS)
    assert {r.auth for r in server.requests} == {f"Bearer {SECRET}"}
    described = eng.describe()
    assert described == {"engine": "openai", "model": "target-model", "base_url": server.url}
    assert "HTTP 503" in caplog.text and SECRET not in caplog.text
    assert isinstance(eng, TargetEngine)


def test_chat_works_inside_a_running_event_loop(serve):
    import asyncio

    server = serve(lambda k, body: (200, {}, ok(), 0))

    async def inside() -> str:
        return engine(server).chat(HELLO, PARAMS)[0][0].text

    assert asyncio.run(inside()) == "hi0"


TARGET = TargetConfig(name="t", source="embedded:tiny-llama", num_layers=4, hidden_size=64, vocab_size=49152)


def test_factory_reads_the_api_key_from_the_named_env_var(serve, monkeypatch):
    server = serve(lambda k, body: (200, {}, ok(), 0))
    cfg = RegenerateConfig(
        engine="openai", openai={"base_url": server.url, "model": "m", "api_key_env": "DS_TEST_KEY", "concurrency": 2}
    )
    monkeypatch.delenv("DS_TEST_KEY", raising=False)
    with pytest.raises(ValueError, match="regenerate.openai.api_key_env: environment variable DS_TEST_KEY is not set"):
        make_engine(cfg, TARGET)
    monkeypatch.setenv("DS_TEST_KEY", SECRET)
    eng = make_engine(cfg, TARGET)
    assert isinstance(eng, OpenAIEngine) and eng.concurrency == 2
    eng.chat(HELLO, PARAMS)
    assert server.requests[0].auth == f"Bearer {SECRET}"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"engine": "openai"}, "regenerate.openai: required when regenerate.engine is 'openai'"),
        ({"openai": {"base_url": "http://x/v1", "model": "m"}}, "regenerate.openai: only used when"),
        ({"engine": "openai", "openai": {"base_url": "x/v1", "model": "m"}}, "must start with http"),
        ({"engine": "openai", "openai": {"base_url": "http://u:p@x/v1", "model": "m"}}, "must not carry credentials"),
        ({"chat_template_sha256": "abc"}, "64 lowercase hex digits"),
        ({"extra_body": {"enable_thinking": True}}, "regenerate.extra_body.enable_thinking: set regenerate.thinking"),
        ({"n": 0}, "greater than 0"),
    ],
)
def test_regenerate_config_errors_name_the_field(data, message):
    with pytest.raises(ValidationError, match=message):
        RegenerateConfig.model_validate(data)
