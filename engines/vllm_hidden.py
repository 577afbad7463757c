"""Target hidden states through vLLM's `extract_hidden_states` method, in-process or in a vLLM worker process.

vLLM numbers its aux hidden-state layers like our taps: aux id k is the residual stream after decoder layer
k counting from 1 (HF `hidden_states[k]`), and id `num_layers` is the last layer's output before the final
norm. The engine asks for the taps plus `num_layers`; the post-norm last hidden state is that output put
through the target's final RMSNorm, applied here with the weights from the model folder.

Each sequence goes in as a prompt with `max_tokens=1`; the CPU-safe connector (`vllm_hidden_connector`)
writes its prompt hidden states to a safetensors file, which this module reads and deletes.
Shape legend: S sequence length, N number of taps, H target hidden size.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from draftsmith.engines import vllm_hidden_worker, vllm_worker
from draftsmith.engines.vllm_offline import VLLMHandle, _Worker, worker_python

log = logging.getLogger(__name__)

WORKER_SCRIPT = Path(vllm_hidden_worker.__file__).resolve()
NORM_KEY = "model.norm.weight"
LAST_HIDDEN = ("post_norm", "pre_norm")


class _HiddenWorker(_Worker):
    """`vllm_hidden_worker.py` under another interpreter, on the offline engine's process handling."""

    script = WORKER_SCRIPT  # same start-up, reader and shutdown as the offline engine; another script

    def capture(self, token_ids: list[list[int]]) -> list[str]:
        return self.request({"token_ids": token_ids}, f"a capture of {len(token_ids)} sequences")["paths"]


class _InProcess:
    """vLLM imported into this interpreter (GPU images)."""

    def __init__(self, config: dict[str, Any]) -> None:
        for key, value in vllm_worker.VLLM_ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
        self.llm = vllm_hidden_worker.build_llm(config)

    def capture(self, token_ids: list[list[int]]) -> list[str]:
        return vllm_hidden_worker.capture(self.llm, token_ids)

    def stop(self) -> None:
        self.llm = None


def _shutdown(backend: _HiddenWorker | _InProcess, out_dir: Path) -> None:
    backend.stop()
    shutil.rmtree(out_dir, ignore_errors=True)


def _read_target(model: Path) -> tuple[int, float, torch.Tensor]:
    """`num_hidden_layers`, `rms_norm_eps` and the final norm weight `[H]` of a Llama-style model folder."""
    cfg_path = model / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path}: no config.json in the target folder")
    cfg = json.loads(cfg_path.read_text())
    for key in ("num_hidden_layers", "rms_norm_eps"):
        if key not in cfg:
            raise ValueError(f"{cfg_path}: field {key!r} is missing")
    for shard in sorted(model.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as fh:
            if NORM_KEY in fh.keys():
                return int(cfg["num_hidden_layers"]), float(cfg["rms_norm_eps"]), fh.get_tensor(NORM_KEY)
    raise ValueError(f"{model}: no safetensors file holds {NORM_KEY!r} (the final RMSNorm of a Llama-style target)")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm as HF computes it: statistics in fp32, weight applied in the input dtype. `[..., H]`."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(x.dtype) * normed.to(x.dtype)


class VLLMHiddenStates(VLLMHandle):
    """Capture the taps and the last hidden state of token sequences with vLLM's `extract_hidden_states`.

    Args:
        model: Local model folder of a Llama-style target.
        taps: Ascending tap layers, 1 <= k < num_layers (tap k = output of decoder layer k = vLLM aux id k).
        last_hidden: `post_norm` (final norm output) or `pre_norm` (last layer output, vLLM aux id num_layers).
        max_model_len: Longest sequence plus the one token vLLM must generate.
        python: Interpreter of a vLLM environment. None: in-process when `vllm` is importable here, else
            `<repo>/.venv-vllm/bin/python`.
        engine_kwargs: More `vllm.LLM` arguments (JSON values), e.g. `{"dtype": "float32", "enforce_eager": True}`.
        log_path: Worker log file; default a fresh file under the temp folder.
        start_timeout_s: How long the worker may take to load the model.
    """

    def __init__(
        self,
        model: str | Path,
        taps: Sequence[int],
        *,
        max_model_len: int,
        last_hidden: str = "post_norm",
        seed: int = 0,
        python: str | None = None,
        engine_kwargs: dict[str, Any] | None = None,
        log_path: str | None = None,
        start_timeout_s: float = 900.0,
    ) -> None:
        self.model = Path(model)
        self.num_layers, self._eps, self._norm_weight = _read_target(self.model)
        self.taps = list(taps)
        if not self.taps or self.taps != sorted(set(self.taps)):
            raise ValueError(f"taps: must be non-empty and strictly ascending, got {self.taps}")
        if not 1 <= self.taps[0] or self.taps[-1] >= self.num_layers:
            raise ValueError(
                f"taps: {self.taps} must lie in 1..{self.num_layers - 1} for a {self.num_layers}-layer target"
            )
        if last_hidden not in LAST_HIDDEN:
            raise ValueError(f"last_hidden: must be one of {LAST_HIDDEN}, got {last_hidden!r}")
        if max_model_len < 2:
            raise ValueError(f"max_model_len: must be at least 2, got {max_model_len}")
        self.last_hidden = last_hidden
        self.max_model_len = max_model_len
        self._out_dir: Path | None = None  # the connector's output folder, made when vLLM starts
        config = {"model": str(self.model), "max_model_len": max_model_len, "seed": seed}
        config |= {"engine_kwargs": dict(engine_kwargs or {}), "aux_layer_ids": [*self.taps, self.num_layers]}
        self._init_runtime(config, python, log_path, start_timeout_s)

    def _start(self) -> _HiddenWorker | _InProcess:
        if self._backend is not None:
            return self._backend
        python = None if self.mode == "in-process" else worker_python(self._python)
        self._out_dir = Path(tempfile.mkdtemp(prefix="vllm-hidden-"))
        config = {**self._config, "out_dir": str(self._out_dir)}
        try:
            if python is None:
                self._backend = _InProcess(config)
            else:
                log_path = self._log_path or Path(tempfile.mkstemp(prefix="vllm-hidden-", suffix=".log")[1])
                log.info("starting vLLM hidden-states worker under %s for %s (log %s)", python, self.model, log_path)
                self._backend = _HiddenWorker(python, config, log_path, self._start_timeout_s)
        except BaseException:
            shutil.rmtree(self._out_dir, ignore_errors=True)
            self._out_dir = None
            raise
        # Also runs at garbage collection or interpreter exit, so neither vLLM nor the files outlive us.
        self._finalizer = weakref.finalize(self, _shutdown, self._backend, self._out_dir)
        return self._backend

    def _check(self, sequences: Sequence[Sequence[int]]) -> list[list[int]]:
        out = []
        for i, seq in enumerate(sequences):
            ids = [int(t) for t in seq]
            if not ids:
                raise ValueError(f"sequences[{i}]: empty token sequence")
            if len(ids) >= self.max_model_len:
                raise ValueError(
                    f"sequences[{i}]: {len(ids)} tokens leave no room for the generated token "
                    f"under max_model_len={self.max_model_len}"
                )
            out.append(ids)
        return out

    def _load(self, index: int, path: str, ids: list[int], last_hidden: str) -> tuple[torch.Tensor, torch.Tensor]:
        data = load_file(path, device="cpu")
        Path(path).unlink()
        if data["token_ids"].tolist() != ids:
            raise RuntimeError(f"sequences[{index}]: vLLM saved hidden states for other tokens ({path})")
        hidden = data["hidden_states"]  # [S, N + 1, H]: the taps, then aux id num_layers
        last = hidden[:, -1]
        if last_hidden == "post_norm":
            last = rms_norm(last, self._norm_weight, self._eps)
        return hidden[:, :-1].contiguous(), last.contiguous()

    def capture(
        self, sequences: Sequence[Sequence[int]], *, last_hidden: str | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per sequence, `taps_SNH` `[S, N, H]` and `last_SH` `[S, H]` in vLLM's compute dtype, in input order.

        `last_hidden` overrides the engine's capture point for this call; both use the same vLLM engine.
        """
        mode = last_hidden or self.last_hidden
        if mode not in LAST_HIDDEN:
            raise ValueError(f"last_hidden: must be one of {LAST_HIDDEN}, got {mode!r}")
        ids = self._check(sequences)
        if not ids:
            return []
        paths = self._start().capture(ids)
        return [self._load(i, p, seq, mode) for i, (p, seq) in enumerate(zip(paths, ids, strict=True))]

    def close(self) -> None:
        """Stop vLLM and remove the capture folder; a later `capture` starts a new engine."""
        super().close()
        self._out_dir = None
