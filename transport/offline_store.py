"""The offline hidden-state store: safetensors shards of many samples, an index, and `dataset.json`.

Layout under the store URL (a local folder or any fsspec URL, `s3://` included):

- `shard-NNNNN.safetensors`: the wire tensors (`draftsmith.transport.sample.encode`) of consecutive samples,
  concatenated along their first axis, plus `offsets` and `last_offsets` `[n+1]` int64 (sample i owns rows
  `offsets[i]:offsets[i+1]` of the per-token tensors and `last_offsets[i]:last_offsets[i+1]` of `last_*`).
- `commits/NNNNN.json`: written only after its shard is completely written (atomic rename locally; an S3
  PUT is visible only once complete), so a shard enters the index only when whole. A rerun resumes after
  the last committed shard whose file still matches its commit (size and digest); from the first one that
  does not, the commits are dropped and those shards written again.
- `index.jsonl` (one row per sample: id, shard, row, offsets, seq_len, loss-token count) and
  `dataset.json` (format version, codec, taps and their convention, capture points, target and tokenizer
  hashes, and per shard its bytes, sample count, sha256 and fast `digest`/`algo`) are written by `finish()`.
"""

import logging
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field

import torch

from draftsmith.core import storage, tensorio
from draftsmith.core.manifest import FAST_HASH, FileEntry, digest
from draftsmith.transport.sample import LAST_TENSORS, SEQ_TENSORS, HiddenSample, StoreCodec, encode

log = logging.getLogger(__name__)

FORMAT_VERSION = 2
COMMITS = "commits"
INDEX = "index.jsonl"
DATASET = "dataset.json"
SHARD_FIELDS = ("shard", "bytes", "sha256", "digest", "algo", "samples", "tokens")


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.safetensors"


@dataclass
class StoreInfo:
    """What `dataset.json` says about the data (everything but the shard list)."""

    codec: StoreCodec
    taps: list[int]
    hidden_size: int
    target: str
    tap_point: str = "layer_output"
    last_hidden: str = "post_norm"
    engine: str = "hf"
    tokenizer_sha256: str = ""
    chat_template_sha256: str = ""
    extra: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict:
        out = asdict(self)
        out["codec"] = asdict(self.codec)
        return out

    @classmethod
    def from_json(cls, d: dict) -> "StoreInfo":
        return cls(**(d | {"codec": StoreCodec(**d["codec"])}))


@dataclass
class _Encoded:
    """One sample as it waits for its shard: already in wire form (bf16/fp8), so fp32 captures are freed."""

    id: str
    wire: dict[str, torch.Tensor]
    loss_tokens: int


def pack_shard(entries: list[_Encoded], meta: dict[str, str]) -> tuple[bytes, list[dict]]:
    """One shard's safetensors bytes and its index rows (without the shard name)."""
    wires = [e.wire for e in entries]
    names = [n for n in SEQ_TENSORS + LAST_TENSORS if n in wires[0]]
    tensors = {n: torch.cat([w[n] for w in wires]) for n in names}
    seq = torch.tensor([len(w["input_ids"]) for w in wires], dtype=torch.int64)
    last = torch.tensor([len(w["last_hidden"]) for w in wires], dtype=torch.int64)
    zero = torch.zeros(1, dtype=torch.int64)
    tensors["offsets"] = torch.cat([zero, seq.cumsum(0)])
    tensors["last_offsets"] = torch.cat([zero, last.cumsum(0)])
    off, loff = tensors["offsets"].tolist(), tensors["last_offsets"].tolist()
    rows = [
        {
            "id": e.id,
            "row": i,
            "start": off[i],
            "length": off[i + 1] - off[i],
            "last_start": loff[i],
            "last_length": loff[i + 1] - loff[i],
            "loss_tokens": e.loss_tokens,
        }
        for i, e in enumerate(entries)
    ]
    return tensorio.dumps(tensors, meta | {"format_version": str(FORMAT_VERSION)}), rows


class ShardWriter:
    """Write samples into `shard_samples`-sized shards under `uri`, resuming after the committed ones.

    Samples must arrive in the same order on every run (the pipeline reads token shards in order), because
    resume skips the first `committed_samples` of the stream.
    """

    def __init__(self, uri: str, info: StoreInfo, shard_samples: int):
        self.uri, self.info, self.shard_samples = uri, info, shard_samples
        self.commits = self._load_commits()
        self._pending: list[_Encoded] = []

    def _load_commits(self) -> list[dict]:
        commits = []
        for name in storage.list_names(storage.join(self.uri, COMMITS)):
            if name.endswith(".json"):
                commits.append(storage.read_json(storage.join(self.uri, COMMITS, name)))
        commits.sort(key=lambda c: c["shard_index"])
        for k, c in enumerate(commits):
            if c["shard_index"] != k:
                raise ValueError(
                    f"{self.uri}/{COMMITS}: shard {k} is missing but shard {c['shard_index']} is committed"
                )
        return self._verified(commits)

    def _verified(self, commits: list[dict]) -> list[dict]:
        """The leading commits whose shard files still match them; later ones are dropped, to be redone,
        because resume skips samples by count and so needs every earlier shard intact."""
        for k, c in enumerate(commits):
            algo = c.get("algo", "sha256")
            record = FileEntry(name=c["shard"], bytes=c["bytes"], digest=c.get("digest", c["sha256"]), algo=algo)
            problem = record.problem(storage.join(self.uri, c["shard"]))
            if problem is None:
                continue
            log.warning(
                "hidden store: %s; dropping commits %d..%d and capturing them again", problem, k, len(commits) - 1
            )
            for dropped in commits[k:]:
                storage.remove_tree(storage.join(self.uri, COMMITS, f"{dropped['shard_index']:05d}.json"))
            return commits[:k]
        return commits

    @property
    def committed_samples(self) -> int:
        return sum(c["samples"] for c in self.commits)

    def add(self, sample: HiddenSample) -> None:
        wire = encode(sample, self.info.codec)
        self._pending.append(_Encoded(sample.id, wire, int(sample.loss_mask.sum())))
        if len(self._pending) == self.shard_samples:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        k = len(self.commits)
        name = shard_name(k)
        blob, rows = pack_shard(self._pending, {"store_format": "draftsmith-hidden"})
        storage.write_bytes(storage.join(self.uri, name), blob)
        commit = {
            "shard_index": k,
            "shard": name,
            "bytes": len(blob),
            "sha256": storage.sha256(blob),
            "digest": digest(blob),
            "algo": FAST_HASH,
            "samples": len(rows),
            "tokens": sum(r["length"] for r in rows),
            "rows": rows,
        }
        storage.write_json(storage.join(self.uri, COMMITS, f"{k:05d}.json"), commit)  # the commit point
        self.commits.append(commit)
        self._pending = []
        log.info("hidden store: %s committed (%d samples, %d bytes)", name, len(rows), len(blob))

    def finish(self) -> dict:
        """Flush the last shard, write `index.jsonl` and `dataset.json`; return the dataset record."""
        self._flush()
        index = [r | {"shard": c["shard"]} for c in self.commits for r in c["rows"]]
        storage.write_jsonl(storage.join(self.uri, INDEX), index)
        dataset = {
            "version": FORMAT_VERSION,
            **self.info.to_json(),
            "shards": [{k: c[k] for k in SHARD_FIELDS if k in c} for c in self.commits],
            "samples": len(index),
            "tokens": sum(r["length"] for r in index),
            "loss_tokens": sum(r["loss_tokens"] for r in index),
        }
        storage.write_json(storage.join(self.uri, DATASET), dataset)
        return dataset


def write_store(uri: str, info: StoreInfo, samples: Iterable[HiddenSample], shard_samples: int) -> dict:
    """Write every sample of `samples` (skipping those already committed) and finish the store."""
    writer = ShardWriter(uri, info, shard_samples)
    for sample in skip(samples, writer.committed_samples):
        writer.add(sample)
    return writer.finish()


def skip(items: Iterable, n: int) -> Iterator:
    it = iter(items)
    for _ in range(n):
        next(it, None)
    yield from it
