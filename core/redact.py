"""Keep credentials out of log lines and error messages.

A server that echoes its request (headers included) in an error body would otherwise put the API key
into the stage log, and from there into Prefect's database. `redact` removes the values of registered
secrets, `Bearer <token>` and `api_key` / `api-key` / `authorization` fields; `install_log_redaction`
applies it to every log record the process creates.
"""

import logging
import re
import threading
from collections.abc import Callable
from typing import Any

MASK = "[redacted]"
# Shorter values would mask ordinary words and digits all over the logs.
_MIN_SECRET_CHARS = 4
_SECRETS: set[str] = set()
_LOCK = threading.Lock()

_FIELD = re.compile(
    r"""(?ix)
    (["']?\b(?:x-)?(?:api[_-]?key|(?:proxy-)?authorization)["']?\s*[:=]\s*["']?)  # name, separator, quote
    ((?:bearer|basic|token)\s+)?  # an auth scheme stays readable
    [^\s"',;&}]+""",
)
# Eight characters at least, so that prose ("bearer of") stays as it is.
_BEARER = re.compile(r"(?i)\b(bearer)\s+[A-Za-z0-9._~+/=-]{8,}")


def register_secret(value: str | None) -> None:
    """Redact `value` wherever it appears from now on (an API key read from the environment)."""
    if value and len(value) >= _MIN_SECRET_CHARS:
        with _LOCK:
            _SECRETS.add(value)


def redact(text: str) -> str:
    """`text` with registered secrets, bearer tokens and credential fields replaced by `[redacted]`."""
    with _LOCK:
        secrets = sorted(_SECRETS, key=len, reverse=True)  # a key that contains another goes first
    for secret in secrets:
        text = text.replace(secret, MASK)
    text = _FIELD.sub(lambda m: f"{m.group(1)}{m.group(2) or ''}{MASK}", text)
    return _BEARER.sub(lambda m: f"{m.group(1)} {MASK}", text)


class RedactingFilter(logging.Filter):
    """Rewrites a record's message and traceback through `redact`; never drops a record."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a bad format string is the handler's to report, as logging does
            return True
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, ()
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        return True


_FILTER = RedactingFilter()


class _RedactingFactory:
    """A log-record factory that redacts each record `previous` makes (installed once)."""

    def __init__(self, previous: Callable[..., logging.LogRecord]) -> None:
        self.previous = previous

    def __call__(self, *args: Any, **kwargs: Any) -> logging.LogRecord:
        record = self.previous(*args, **kwargs)
        _FILTER.filter(record)
        return record


def install_log_redaction() -> None:
    """Redact every log record at creation, before any handler sees it.

    A filter on the root handler alone would run too late: records of loggers with their own handlers
    (Prefect's API log handler, which writes to its database) reach those handlers first.
    """
    previous = logging.getLogRecordFactory()
    if not isinstance(previous, _RedactingFactory):
        logging.setLogRecordFactory(_RedactingFactory(previous))
