"""A fake OpenAI-compatible `/v1/chat/completions` server on 127.0.0.1, scripted per request.

`ChatServer(respond)` calls `respond(request)` for every POST and sends the `Reply` it returns: any status,
body and headers, after a delay, or a misbehaviour a real server shows under load (no answer at all, or a
body cut off halfway with the connection dropped). Every request is recorded. The engine tests, the
regenerate stage's tests, the secret-redaction faults and the flaky-endpoint scenario all script this one
server.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass(frozen=True)
class Request:
    index: int  # arrival order, from 0
    body: dict
    headers: dict[str, str]
    t: float  # time.time() at arrival

    @property
    def auth(self) -> str | None:
        return self.headers.get("Authorization")

    @property
    def question(self) -> str:
        """The last message's content."""
        return self.body["messages"][-1]["content"]


@dataclass
class Reply:
    status: int = 200
    body: dict | str = field(default_factory=dict)  # a dict is sent as JSON
    headers: dict[str, str] = field(default_factory=dict)
    wait_s: float = 0.0  # before answering
    hang: bool = False  # answer nothing: close the connection after `wait_s`
    cut: bool = False  # send the headers and half the body, then drop the connection
    sent: Callable[[], None] | None = None  # called once the whole reply is written


def completion(content: str, *, finish_reason: str = "stop", completion_tokens: int = 3) -> dict:
    """A one-choice `chat.completion` body."""
    choice = {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": finish_reason}
    return {"choices": [choice], "usage": {"completion_tokens": completion_tokens}}


class ChatServer:
    """Serves `respond(request) -> Reply` until `close()`; `requests` holds every request, `max_in_flight` the
    most answered at once. `keep_alive`: HTTP/1.1 connections, as real servers keep them (a dropped reply
    then hits a pooled connection)."""

    def __init__(self, respond: Callable[[Request], Reply], *, keep_alive: bool = False) -> None:
        self.respond = respond
        self.requests: list[Request] = []
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self, keep_alive))
        self.httpd.daemon_threads = True
        self.httpd.block_on_close = False  # hung handlers must not hold up close()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def _arrived(self, body: dict, headers: dict[str, str]) -> Request:
        with self.lock:
            request = Request(len(self.requests), body, headers, time.time())
            self.requests.append(request)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        return request

    def _done(self) -> None:
        with self.lock:
            self.in_flight -= 1

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> ChatServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _handler(server: ChatServer, keep_alive: bool) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1" if keep_alive else "HTTP/1.0"

        def log_message(self, *args: object) -> None:
            pass

        def handle(self) -> None:
            try:
                super().handle()
            except (BrokenPipeError, ConnectionResetError, OSError):
                pass  # the client gave up (timed out, hung up): expected

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            request = server._arrived(body, dict(self.headers))
            try:
                self._send(server.respond(request))
            finally:
                server._done()

        def _send(self, reply: Reply) -> None:
            time.sleep(reply.wait_s)
            if reply.hang:
                self.close_connection = True
                return
            data = (json.dumps(reply.body) if isinstance(reply.body, dict) else reply.body).encode()
            self.send_response(reply.status)
            if isinstance(reply.body, dict) and "Content-Type" not in reply.headers:
                self.send_header("Content-Type", "application/json")
            for name, value in reply.headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if reply.cut:
                self.wfile.write(data[: len(data) // 2])
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)
                self.close_connection = True
                return
            self.wfile.write(data)
            if reply.sent is not None:
                reply.sent()

    return Handler
