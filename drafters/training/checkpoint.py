"""DCP checkpoints with rotation: model and optimizer shards, scheduler, counters, RNG and data position.

Layout under the checkpoint root (a local folder or an fsspec URL such as `s3://...`): `step-00000040/`
holds DCP's shard files, `rng-<rank>.safetensors` (each rank's torch RNG) and, written last by rank 0
once every rank has finished, `trainer.json` (step, scheduler, skip counters; the data position is the
step, because epoch plans are rebuilt from the seed). A folder without `trainer.json` is an interrupted
save: resume ignores it and the next save replaces it. No pickle anywhere.
"""

import logging
import re

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load, save
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from drafters.training.fsdp import Dist
from drafters.training.loop import Trainer
from draftsmith import storage

log = logging.getLogger(__name__)
_STEP = re.compile(r"^step-(\d{8})$")
MARKER = "trainer.json"


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


class Checkpoints:
    """Save, find and restore the trainer's checkpoints under `root`, which every rank can reach."""

    def __init__(self, root: str, keep: int, d: Dist) -> None:
        self.root, self.keep, self.d = root, keep, d

    def complete(self) -> list[tuple[int, str]]:
        """Finished checkpoints `(step, url)`, oldest first."""
        if not storage.exists(self.root):
            return []
        found = [
            (int(m.group(1)), storage.join(self.root, n))
            for n in storage.list_names(self.root)
            if (m := _STEP.match(n))
        ]
        return sorted((s, url) for s, url in found if storage.exists(storage.join(url, MARKER)))

    def _state(self, trainer: Trainer) -> dict:
        return {
            "model": get_model_state_dict(trainer.module),
            "optim": get_optimizer_state_dict(trainer.module, trainer.opt),
        }

    def save(self, trainer: Trainer) -> str:
        """Collective: every rank writes its shards and RNG; rank 0 marks the checkpoint complete and rotates."""
        url = storage.join(self.root, f"step-{trainer.step:08d}")
        if self.d.is_main:
            if storage.exists(url):
                storage.remove_tree(url)
            storage.makedirs(url)
        dist.barrier()
        local = storage.is_local(url)
        writer = FileSystemWriter(str(storage.local_path(url))) if local else FsspecWriter(url)
        dcp.save(self._state(trainer), storage_writer=writer)
        storage.write_bytes(storage.join(url, f"rng-{self.d.rank}.safetensors"), save(_rng_state(self.d.device)))
        dist.barrier()
        if self.d.is_main:
            storage.write_json(storage.join(url, MARKER), trainer.state() | {"world": self.d.world})
            for _, old in self.complete()[: -self.keep]:
                storage.remove_tree(old)
        dist.barrier()
        return url

    def resume(self, trainer: Trainer) -> int:
        """Restore the newest complete checkpoint into `trainer`; returns its step (0 when there is none)."""
        done = self.complete()
        if not done:
            return 0
        step, url = done[-1]
        meta = storage.read_json(storage.join(url, MARKER))
        state = self._state(trainer)
        reader = FileSystemReader(str(storage.local_path(url))) if storage.is_local(url) else FsspecReader(url)
        dcp.load(state, storage_reader=reader)
        set_model_state_dict(trainer.module, state["model"])
        set_optimizer_state_dict(trainer.module, trainer.opt, state["optim"])
        trainer.load_state(meta)
        rng_url = storage.join(url, f"rng-{self.d.rank}.safetensors")
        if meta["world"] == self.d.world and storage.exists(rng_url):
            saved = load(storage.read_bytes(rng_url))
            torch.set_rng_state(saved["cpu"])
            if "cuda" in saved and self.d.device.type == "cuda":
                torch.cuda.set_rng_state(saved["cuda"], self.d.device)
        elif self.d.is_main:
            log.warning(
                "checkpoint %s was written by %d ranks, resuming on %d: RNG restarts", url, meta["world"], self.d.world
            )
        return step
