"""The API key stays out of logs and error messages, even from a server that echoes it back."""

import io
import json
import logging

import pytest

from draftsmith.core.redact import MASK, install_log_redaction, redact, register_secret
from draftsmith.engines.base import ChatRequest, SamplingParams
from draftsmith.engines.openai_http import EngineRequestError, EngineUnavailableError, OpenAIEngine
from tests.support.openai_server import ChatServer, Reply, Request

pytestmark = pytest.mark.unit
KEY = "sk-faults-0123456789abcdef"
HELLO = [ChatRequest(messages=[{"role": "user", "content": "hello"}])]


@pytest.fixture
def echo_server():
    """A chat server on 127.0.0.1 that answers with `status` and a body quoting the request's headers."""
    state = {"status": 500}

    def respond(request: Request) -> Reply:
        auth = request.auth or ""
        headers = json.dumps(request.headers)
        return Reply(state["status"], f"upstream failed for Authorization: {auth}; headers={headers}; key={auth[7:]}")

    with ChatServer(respond) as server:
        yield server.url, state


def _assert_clean(caplog, err: BaseException) -> None:
    for record in caplog.records:
        assert KEY not in record.getMessage()
    assert KEY not in caplog.text and KEY not in str(err)
    assert MASK in str(err)  # the body still says what happened


@pytest.mark.parametrize(("status", "error"), [(500, EngineUnavailableError), (400, EngineRequestError)])
def test_an_echoed_key_is_in_no_log_record_and_no_error(echo_server, caplog, status, error):
    url, state = echo_server
    state["status"] = status
    engine = OpenAIEngine(url, "target", api_key=KEY, max_retries=1, backoff_s=0.0, timeout_s=5)
    with caplog.at_level(logging.DEBUG), pytest.raises(error) as excinfo:
        engine.chat(HELLO, SamplingParams(max_tokens=8))
    if status == 500:
        assert "retry 1/1" in caplog.text  # the retry was logged, body included
    _assert_clean(caplog, excinfo.value)


@pytest.mark.parametrize(
    "text",
    [
        "Authorization: Bearer abcdefgh12345678",
        '{"authorization": "Bearer abcdefgh12345678"}',
        '{"api_key": "abcdefgh12345678"}',
        "GET /v1?api-key=abcdefgh12345678&x=1",
        "x-api-key: abcdefgh12345678",
        "token was Bearer abcdefgh12345678.",
    ],
)
def test_credential_patterns_are_masked(text):
    assert "abcdefgh12345678" not in redact(text) and MASK in redact(text)


def test_prose_is_left_alone():
    assert redact("the bearer of bad news; authorization required") == "the bearer of bad news; authorization required"


def test_every_log_record_is_redacted_once_installed():
    """What the CLI installs: records of any logger, message, arguments and traceback, before any handler."""
    previous = logging.getLogRecordFactory()
    out = io.StringIO()
    logger = logging.getLogger("draftsmith.faults.secrets")
    handler = logging.StreamHandler(out)
    logger.addHandler(handler)
    try:
        install_log_redaction()
        register_secret("s3cr3t-value-42")
        logger.warning("server said %s", "key s3cr3t-value-42")
        try:
            raise RuntimeError("Authorization: Bearer s3cr3t-value-42")
        except RuntimeError:
            logger.error("request failed", exc_info=True)
    finally:
        logger.removeHandler(handler)
        logging.setLogRecordFactory(previous)
    assert "s3cr3t" not in out.getvalue() and out.getvalue().count(MASK) >= 2
