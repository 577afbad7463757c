"""Reading the offline store: one sample at a time by ranged reads, and a prefetching batch loader.

A sample is rows `[start, start+length)` of each per-token tensor in its shard and rows
`[last_start, last_start+last_length)` of the `last_*` tensors; in a safetensors file those rows are one
contiguous byte range per tensor. Local shards are memory-mapped, so a read touches only those pages;
remote shards (`s3://`) are fetched as byte ranges (fsspec `cat_ranges`, concurrent), never whole.
"""

import json
import mmap
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from draftsmith.core import storage
from draftsmith.core.manifest import FileEntry
from draftsmith.transport.offline_store import DATASET, FORMAT_VERSION, INDEX, StoreInfo
from draftsmith.transport.sample import LAST_TENSORS, SEQ_TENSORS, HiddenSample, decode

# Remote tensors of a few bytes a token, fetched whole once per shard (see `_Shard._cache_small`).
SMALL_TENSORS = ("input_ids", "loss_mask", "hidden_scales", "last_scales")
_DTYPES = {
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F16": torch.float16,
    "F8_E4M3": torch.float8_e4m3fn,
    "I32": torch.int32,
    "I64": torch.int64,
    "U8": torch.uint8,
}


@dataclass(frozen=True)
class _Tensor:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file

    @property
    def row_bytes(self) -> int:
        n = 1
        for d in self.shape[1:]:
            n *= d
        return n * self.dtype.itemsize


class _Shard:
    """One shard's header (read once) and its bytes: an mmap locally, ranged reads remotely."""

    def __init__(self, url: str):
        self.url = url
        self._map: mmap.mmap | None = None
        self._small: dict[str, torch.Tensor] = {}
        if storage.is_local(url):
            with open(storage.local_path(url), "rb") as fh:
                self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            head = self._map[:8]
        else:
            head = storage.read_ranges(url, [(0, 8)])[0]
        n = int.from_bytes(head, "little")
        header = json.loads(
            self._map[8 : 8 + n] if self._map is not None else storage.read_ranges(url, [(8, 8 + n)])[0]
        )
        self.tensors = {
            name: _Tensor(_DTYPES[t["dtype"]], tuple(t["shape"]), 8 + n + t["data_offsets"][0])
            for name, t in header.items()
            if name != "__metadata__"
        }

    def _cache_small(self, names: list[str]) -> None:
        """Fetch whole, once, the tensors with tiny rows (ids, mask, fp8 scales: a few bytes a token), so a
        remote sample costs one request per wide tensor instead of one per tensor: object stores are bound
        by requests, not bytes, at these sizes."""
        todo = sorted({n for n in names if n not in self._small and n in SMALL_TENSORS})
        if not todo:
            return
        ranges = [
            (self.tensors[n].begin, self.tensors[n].begin + self.tensors[n].row_bytes * self.tensors[n].shape[0])
            for n in todo
        ]
        for name, blob in zip(todo, storage.read_ranges(self.url, ranges), strict=True):
            t = self.tensors[name]
            self._small[name] = torch.frombuffer(bytearray(blob), dtype=t.dtype).reshape(t.shape)

    def rows(self, spans_list: list[dict[str, tuple[int, int]]]) -> list[dict[str, torch.Tensor]]:
        """Per sample, `{tensor: rows [a, b)}` → the row slices, copied out of the file.

        Remotely, every range of every sample goes in one `cat_ranges` call, which fsspec runs concurrently:
        a batch costs about one round trip, not one per tensor per sample.
        """
        flat: list[tuple[str, int, int]] = [(n, a, b) for spans in spans_list for n, (a, b) in spans.items()]
        if self._map is None:
            self._cache_small([n for n, _, _ in flat])
        ranges = []
        for name, a, b in flat:
            t = self.tensors[name]
            if name in self._small:
                ranges.append((0, 0))
            else:
                ranges.append((t.begin + a * t.row_bytes, t.begin + b * t.row_bytes))
        if self._map is not None:
            blobs = [self._map[s:e] for s, e in ranges]
        else:
            wanted = [r for r, (n, _, _) in zip(ranges, flat, strict=True) if n not in self._small]
            fetched = iter(storage.read_ranges(self.url, wanted))
            blobs = [b"" if n in self._small else next(fetched) for n, _, _ in flat]
        out: list[dict[str, torch.Tensor]] = []
        it = iter(zip(flat, blobs, strict=True))
        for spans in spans_list:
            sample = {}
            for (name, a, b), blob in (next(it) for _ in spans):
                t = self.tensors[name]
                if name in self._small:
                    sample[name] = self._small[name][a:b].clone()
                    continue
                data = torch.frombuffer(bytearray(blob), dtype=t.dtype) if blob else torch.empty(0, dtype=t.dtype)
                sample[name] = data.reshape((b - a, *t.shape[1:]))
            out.append(sample)
        return out


class OfflineDataset:
    """Map-style access to a finished store: `len`, `lengths`, `ids`, `[i] -> HiddenSample`."""

    def __init__(self, uri: str):
        self.uri = uri
        meta_url = storage.join(uri, DATASET)
        if not storage.exists(meta_url):
            raise FileNotFoundError(f"{meta_url}: no dataset.json; the hidden-state store is missing or unfinished")
        self.meta = storage.read_json(meta_url)
        if self.meta.get("version") != FORMAT_VERSION:
            raise ValueError(f"{meta_url}: store format version {self.meta.get('version')}, expected {FORMAT_VERSION}")
        self.info = StoreInfo.from_json({k: v for k, v in self.meta.items() if k in StoreInfo.__dataclass_fields__})
        self.index = storage.read_jsonl(storage.join(uri, INDEX))
        self._records = {s["shard"]: s for s in self.meta["shards"]}
        self._shards: dict[str, _Shard] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.index)

    @property
    def lengths(self) -> list[int]:
        return [r["length"] for r in self.index]

    @property
    def ids(self) -> list[str]:
        return [r["id"] for r in self.index]

    def _shard(self, name: str) -> _Shard:
        with self._lock:
            if name not in self._shards:
                self._shards[name] = _Shard(self._checked_size(name))
            return self._shards[name]

    def _checked_size(self, name: str) -> str:
        """The shard's URL, once its size is the recorded one: a cut shard would otherwise surface as a
        reshape error deep in training, naming no file."""
        url = storage.join(self.uri, name)
        want = self._records.get(name, {}).get("bytes")
        got = storage.size(url)
        if want is not None and got != want:
            raise ValueError(f"{url}: {got} bytes, {DATASET} recorded {want}; the store is damaged, capture it again")
        return url

    def _spans(self, i: int, shard: _Shard) -> dict[str, tuple[int, int]]:
        row = self.index[i]
        seq = (row["start"], row["start"] + row["length"])
        last = (row["last_start"], row["last_start"] + row["last_length"])
        spans = {n: seq for n in SEQ_TENSORS if n in shard.tensors}
        return spans | {n: last for n in LAST_TENSORS if n in shard.tensors}

    def wires(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        """The stored tensors of these samples, exactly as written (`draftsmith.transport.sample.encode` output)."""
        out: dict[int, dict[str, torch.Tensor]] = {}
        by_shard: dict[str, list[int]] = {}
        for i in indices:
            by_shard.setdefault(self.index[i]["shard"], []).append(i)
        for name, members in by_shard.items():
            shard = self._shard(name)
            for i, wire in zip(members, shard.rows([self._spans(i, shard) for i in members]), strict=True):
                out[i] = wire
        return [out[i] for i in indices]

    def wire(self, i: int) -> dict[str, torch.Tensor]:
        return self.wires([i])[0]

    def get_many(self, indices: list[int]) -> list[HiddenSample]:
        """Samples `indices`, in that order, read with one batched request per shard."""
        return [
            decode(self.index[i]["id"], w, self.info.codec) for i, w in zip(indices, self.wires(indices), strict=True)
        ]

    def __getitem__(self, i: int) -> HiddenSample:
        return self.get_many([i])[0]

    def verify(self) -> None:
        """Check every shard's size and digest against `dataset.json` (reads every byte, streamed)."""
        for s in self.meta["shards"]:
            digest, algo = (s["digest"], s["algo"]) if "digest" in s else (s["sha256"], "sha256")
            record = FileEntry(name=s["shard"], bytes=s["bytes"], digest=digest, algo=algo)
            problem = record.problem(storage.join(self.uri, s["shard"]))
            if problem is not None:
                raise ValueError(f"{problem} ({DATASET})")


class PrefetchLoader:
    """Yield `[HiddenSample]` per batch of indices, reading up to `prefetch` batches ahead on `workers` threads.

    Reads are I/O (S3) or page faults and copies (mmap), which release the GIL, so threads overlap them
    with the training step.
    """

    def __init__(self, dataset: OfflineDataset, batches: Iterable[list[int]], *, workers: int = 2, prefetch: int = 4):
        self.dataset, self.batches, self.workers, self.prefetch = dataset, batches, workers, max(1, prefetch)

    def _load(self, batch: list[int]) -> list[HiddenSample]:
        return self.dataset.get_many(batch)

    def __iter__(self) -> Iterator[list[HiddenSample]]:
        with ThreadPoolExecutor(self.workers, thread_name_prefix="hidden-prefetch") as pool:
            queue: deque[Future] = deque()
            for batch in self.batches:
                queue.append(pool.submit(self._load, batch))
                if len(queue) >= self.prefetch:
                    yield queue.popleft().result()
            while queue:
                yield queue.popleft().result()
