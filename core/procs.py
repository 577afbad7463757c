"""Child processes that die with the process that started them, even when it is SIGKILLed.

A child in its own session (so that its whole group can be signalled) no longer gets the terminal's or the
job's signals; `prctl(PR_SET_PDEATHSIG, SIGKILL)` makes the kernel kill it when its parent goes. Linux only;
elsewhere these are no-ops.

The kernel sends that signal when the parent *thread* that forked the child exits, not the process: a child
started from a short-lived thread would be killed with that thread. `popen_kwargs` therefore arms it only
from the main thread, or when the caller says its thread waits for the child to the end.
"""

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

PR_SET_PDEATHSIG = 1


def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def die_with_parent(parent_pid: int | None = None) -> None:
    """Have the kernel SIGKILL this process when its parent exits; if `parent_pid` is given and is no
    longer our parent (it died before the call), die now rather than run on as an orphan."""
    prctl = _prctl()
    if prctl is None:
        return
    prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)


def _preexec(prctl: Callable[..., int], parent: int) -> Callable[[], None]:
    # Runs in the forked child before exec: only the already-resolved C call and os functions, nothing
    # that might take a lock another thread held at fork time.
    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)  # the parent died between fork and here: do not start an orphan

    return arm


def popen_kwargs(*, caller_waits: bool = False) -> dict[str, Any]:
    """`subprocess.Popen` keywords for a child in its own session that dies with this process.

    `caller_waits`: the calling thread lives until the child ends (it waits for it), so the death signal
    may be armed from a thread other than the main one.
    """
    kwargs: dict[str, Any] = {"start_new_session": True}
    prctl = _prctl()
    if prctl is not None and (caller_waits or threading.current_thread() is threading.main_thread()):
        kwargs["preexec_fn"] = _preexec(prctl, os.getpid())
    return kwargs


def python_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) for a Python child started with `-m` or `-c`: `PYTHONSAFEPATH=1` keeps its
    working directory off `sys.path`.

    Started from a checkout, the working directory's top-level folders (`kernels/`, `core/`, ...) are draftsmith's
    subpackages; first on `sys.path` they would shadow installed packages of the same name, such as the
    `kernels` package that transformers imports.
    """
    return {**(os.environ if env is None else env), "PYTHONSAFEPATH": "1"}
