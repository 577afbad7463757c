"""`TargetEngine` over an OpenAI-compatible `/v1/chat/completions` server (vLLM, SGLang, TokenSpeed, hosted).

Requests run concurrently on one `httpx.AsyncClient` under an `asyncio.Semaphore`. Throttling (429),
server errors (5xx), dropped connections and timeouts are retried with exponential backoff and jitter,
waiting at least as long as a `Retry-After` header asks; any other 4xx is a permanent error. After the
last retry a transient failure surfaces as `EngineUnavailableError`, a `ConnectionError`, so the stage
task's own transient-only retry policy applies. The API key is sent as a Bearer token and appears in no
log line, error message or `describe()`: error bodies are redacted (`draftsmith.core.redact`), since a server
may echo the request's headers back.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import email.utils
import logging
import random
import time
from collections.abc import Coroutine, Sequence
from typing import Any, Literal
from urllib.parse import urlsplit

import httpx

from draftsmith.core.redact import redact, register_secret
from draftsmith.engines.base import ChatRequest, Completion, SamplingParams

log = logging.getLogger(__name__)

_STOP = {"stop", "eos", "end_turn", "stop_sequence", "tool_calls", "function_call"}
_EXCERPT = 500
# Redacted before the cut, with this much room, so a key straddling the cut is masked whole, not in part.
_REDACT_WINDOW = 4096
# Network trouble worth a retry; other transport errors (a malformed URL, a proxy refusal) are not.
_TRANSIENT = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)
_MAX_RETRY_AFTER_S = 300.0


class EngineRequestError(RuntimeError):
    """The server refused a request for a reason a retry cannot fix (a 4xx other than 429, a bad body)."""


class EngineUnavailableError(ConnectionError):
    """The server stayed unreachable, throttled or failing through every retry."""


def _excerpt(text: str) -> str:
    """The start of a response body, fit for a log line: credentials masked, then cut."""
    return redact(text[: _EXCERPT + _REDACT_WINDOW])[:_EXCERPT]


def _finish(reason: str | None) -> Literal["stop", "length"]:
    # Anything but a clean end (length, content_filter, abort...) leaves the answer incomplete.
    return "stop" if reason in _STOP else "length"


def _retry_after(headers: httpx.Headers) -> float | None:
    """Seconds asked for by a `Retry-After` header (delta-seconds or an HTTP date)."""
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None  # unparseable: fall back to our own backoff
    return max(0.0, when.timestamp() - time.time())


def parse_choices(data: dict[str, Any], n: int, where: str) -> list[Completion]:
    """The `n` completions of one chat-completions response body.

    Reasoning comes from `message.reasoning_content` (vLLM, SGLang, DeepSeek) or `message.reasoning`
    (OpenRouter, newer vLLM). `usage.completion_tokens` counts all choices together, so it is split across
    them unless a choice carries its own count.
    """
    choices = data.get("choices")
    if not isinstance(choices, list) or len(choices) != n:
        got = len(choices) if isinstance(choices, list) else "no"
        raise EngineRequestError(f"{where}: asked for n={n} choices, the server returned {got}")
    choices = sorted(choices, key=lambda c: c.get("index", 0))
    total = (data.get("usage") or {}).get("completion_tokens") or 0
    out = []
    for i, choice in enumerate(choices):
        msg = choice.get("message") or {}
        own = (choice.get("usage") or {}).get("completion_tokens")
        tokens = own if own is not None else total // n + (1 if i < total % n else 0)
        out.append(
            Completion(
                text=(msg.get("content") or "").strip(),
                num_tokens=int(tokens),
                finish_reason=_finish(choice.get("finish_reason")),
                reasoning=msg.get("reasoning_content") or msg.get("reasoning") or None,
                tool_calls=msg.get("tool_calls") or None,
            )
        )
    return out


def _wire_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # Earlier turns' reasoning is not sent back: chat servers reject or drop the field, and thinking
    # templates render history without it.
    return [{k: v for k, v in m.items() if k not in ("reasoning_content", "reasoning")} for m in messages]


def _run(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run `coro` to completion from sync code, even when this thread already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


class OpenAIEngine:
    """Chat completions from an OpenAI-compatible server.

    Args:
        base_url: Server URL up to and including `/v1` (`http://127.0.0.1:8000/v1`).
        model: The model name the server serves the target under.
        api_key: Sent as `Authorization: Bearer ...` when given.
        concurrency: Requests in flight at once.
        timeout_s: Per-request timeout (connect, read, write, pool).
        max_retries: Retries per request of transient failures.
        backoff_s: First retry delay; doubles each retry, times a jitter in [0.5, 1.5).
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        concurrency: int = 8,
        timeout_s: float = 600,
        max_retries: int = 5,
        backoff_s: float = 1.0,
    ) -> None:
        if concurrency <= 0 or timeout_s <= 0 or max_retries < 0 or backoff_s < 0:
            raise ValueError("OpenAIEngine: concurrency and timeout_s must be positive, max_retries and backoff_s >= 0")
        if urlsplit(base_url).username is not None:
            # httpx logs every request URL, so credentials there would leak into the logs.
            raise ValueError("OpenAIEngine: base_url must not carry credentials; pass api_key instead")
        self.base_url = base_url.rstrip("/")
        self.url = self.base_url + "/chat/completions"
        self.model = model
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        register_secret(api_key)
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s

    def describe(self) -> dict[str, str]:
        """The remote template is unknown here; the stage records a declared or local hash instead."""
        return {"engine": "openai", "model": self.model, "base_url": self.base_url}

    def body(self, request: ChatRequest, params: SamplingParams) -> dict[str, Any]:
        """The JSON body of one request: sampling fields, then `extra_body` merged over them."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": _wire_messages(request.messages),
            "temperature": params.temperature,
            "top_p": params.top_p,
            "max_tokens": params.max_tokens,
            "n": params.n,
        }
        if params.seed is not None:
            body["seed"] = params.seed
        if request.tools:
            body["tools"] = request.tools
        return body | params.extra_body

    def chat(self, requests: Sequence[ChatRequest], params: SamplingParams) -> list[list[Completion]]:
        """`params.n` completions per request, in request order; the first permanent failure raises."""
        return _run(self._chat_all([self.body(r, params) for r in requests], params.n))

    async def _chat_all(self, bodies: list[dict[str, Any]], n: int) -> list[list[Completion]]:
        limit = asyncio.Semaphore(self.concurrency)
        limits = httpx.Limits(max_connections=self.concurrency, max_keepalive_connections=self.concurrency)
        async with httpx.AsyncClient(timeout=self.timeout_s, headers=self._headers, limits=limits) as client:

            async def one(index: int, body: dict[str, Any]) -> list[Completion]:
                async with limit:
                    data = await self._post(client, body, f"request {index}")
                return parse_choices(data, n, f"{self.base_url} request {index}")

            tasks = [asyncio.ensure_future(one(i, b)) for i, b in enumerate(bodies)]
            try:
                return list(await asyncio.gather(*tasks))
            finally:
                for t in tasks:
                    t.cancel()

    def _delay(self, attempt: int, retry_after: float | None) -> float:
        backoff = self.backoff_s * (2**attempt) * (0.5 + random.random())
        if retry_after is None:
            return backoff
        return max(backoff, min(retry_after, _MAX_RETRY_AFTER_S))

    async def _post(self, client: httpx.AsyncClient, body: dict[str, Any], what: str) -> dict[str, Any]:
        """POST one body, retrying transient failures; the parsed JSON response."""
        where = f"openai engine: POST {self.url} ({what})"
        for attempt in range(self.max_retries + 1):
            retry_after = None
            try:
                resp = await client.post(self.url, json=body)
            except _TRANSIENT as err:
                problem = f"{type(err).__name__}: {redact(str(err))}"
            else:
                if resp.status_code < 400:
                    try:
                        return resp.json()
                    except ValueError as err:
                        raise EngineRequestError(f"{where}: answered non-JSON: {_excerpt(resp.text)!r}") from err
                problem = f"HTTP {resp.status_code}: {_excerpt(resp.text)}"
                if resp.status_code != 429 and resp.status_code < 500:
                    raise EngineRequestError(f"{where}: {problem}")
                retry_after = _retry_after(resp.headers)
            if attempt == self.max_retries:
                raise EngineUnavailableError(f"{where}: failing after {self.max_retries} retries; last: {problem}")
            delay = self._delay(attempt, retry_after)
            log.warning("%s: %s; retry %d/%d in %.2f s", where, problem, attempt + 1, self.max_retries, delay)
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Nothing held between calls: each `chat` opens and closes its own connection pool."""
