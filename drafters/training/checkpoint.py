"""DCP checkpoints with rotation: model and optimizer shards, scheduler, counters, RNG and data position.

Layout under the checkpoint root (a local folder or an fsspec URL such as `s3://...`): `step-00000040/`
holds DCP's shard files, `rng-<rank>.safetensors` (each rank's torch RNG) and, written last by rank 0
once every rank has finished, `trainer.json` (step, scheduler, skip counters; the data position is the
step, because epoch plans are rebuilt from the seed). A folder without `trainer.json` is an interrupted
save: resume ignores it and the next save replaces it.

DCP itself pickles: its `.metadata` file is a pickled `Metadata`, and non-tensor entries (the optimizer's
param groups) are `torch.save`d into the shard files. Torch reads both with unrestricted unpickling, so
a checkpoint folder someone else can write to would run their code on resume. Resume reads `.metadata`
with an unpickler that admits only the classes DCP metadata is made of (`SafeFileSystemReader`,
`SafeFsspecReader`) and the non-tensor entries with `torch.load(weights_only=True)` (`SafeLoadPlanner`);
anything else raises `UnsafeCheckpointError` naming the file. Tensors, RNG state and counters are never
pickled (DCP tensor bytes, safetensors, JSON).
"""

import io
import logging
import pickle
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load, save
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from draftsmith.core import storage
from draftsmith.drafters.training.fsdp import Dist
from draftsmith.drafters.training.loop import Trainer

log = logging.getLogger(__name__)
_STEP = re.compile(r"^step-(\d{8})$")
MARKER = "trainer.json"


_DCP_META = "torch.distributed.checkpoint.metadata"
# Every global a DCP `.metadata` pickle legitimately names (torch 2.x): its dataclasses and enum, the
# file layout record, and the values inside them (sizes, layouts, the checkpoint path). Dtypes are
# checked separately. Constructing any of these runs no code beyond a dataclass or value constructor.
_METADATA_GLOBALS = frozenset(
    {
        *(
            (_DCP_META, name)
            for name in (
                "Metadata",
                "StorageMeta",
                "MetadataIndex",
                "TensorProperties",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
    }
)


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file asks to unpickle something DCP never writes: refused rather than run."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(f"{module}.{name} is not part of DCP metadata")


def read_dcp_metadata(data: bytes, where: str) -> Metadata:
    """Unpickle DCP's `.metadata` bytes, admitting only the classes DCP metadata is made of."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except UnsafeCheckpointError as err:
        raise UnsafeCheckpointError(f"{where}: refusing to load this checkpoint metadata: {err}") from None
    except Exception as err:  # a truncated or garbled file: any unpickling error
        raise UnsafeCheckpointError(f"{where}: unreadable checkpoint metadata: {err!r}") from err
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{where}: holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata


class _SafeMetadata:
    """`read_metadata` of torch's `FileSystemReader` (2.13), with the restricted unpickler."""

    # What the reader this is mixed into (FileSystemReader, FsspecReader) provides; declared, not defined.
    fs: Any
    load_id: str
    _get_metadata_path: Callable[..., Any]

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = read_dcp_metadata(stream.read(), str(path))
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeFileSystemReader(_SafeMetadata, FileSystemReader):
    """A local DCP checkpoint, its metadata read without arbitrary unpickling."""


class SafeFsspecReader(_SafeMetadata, FsspecReader):
    """A DCP checkpoint behind an fsspec URL, its metadata read without arbitrary unpickling."""


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that non-tensor entries are read with `weights_only=True`
    (the default planner unpickles them without restriction)."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            raise UnsafeCheckpointError(f"{self.where}: refusing to load checkpoint entry {fqn!r}: {err}") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def load_dcp(state: dict, url: str) -> None:
    """Load the DCP checkpoint at `url` (a local folder or fsspec URL) into `state`, in place."""
    reader = SafeFileSystemReader(str(storage.local_path(url))) if storage.is_local(url) else SafeFsspecReader(url)
    # Read once up front: inside `dcp.load` a refusal would surface only as text in a generic assertion.
    reader.read_metadata()
    try:
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(url))
    except CheckpointException as err:
        for failure in err.failures.values():
            if isinstance(failure[0], UnsafeCheckpointError):
                raise failure[0] from err
        raise


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
        load_dcp(state, url)
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
