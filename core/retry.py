"""Which task failures are worth a retry: transient I/O only, never bad input, OOM or NaN."""

from typing import Any

TRANSIENT_TYPES: tuple[type[BaseException], ...] = (ConnectionError, TimeoutError)
# Remote storage clients raise their own classes for throttling and dropped connections.
TRANSIENT_NAMES = {"ClientConnectionError", "ServerDisconnectedError", "EndpointConnectionError", "ReadTimeoutError"}

RETRIES = 2
RETRY_DELAYS: list[float] = [5, 30]


def is_transient(exc: BaseException | None) -> bool:
    """True when `exc`, or an exception it was raised from, is a network or timeout error."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, TRANSIENT_TYPES) or type(exc).__name__ in TRANSIENT_NAMES:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def transient_only(task: Any, task_run: Any, state: Any) -> bool:
    """A Prefect `retry_condition_fn`: retry a failed task run only for transient errors."""
    data = getattr(state, "data", None)
    if not isinstance(data, BaseException):
        data = state.result(raise_on_failure=False)
    return is_transient(data if isinstance(data, BaseException) else None)
