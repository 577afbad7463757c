"""The tokenize stage's shards as the later stages read them: one `tokens-NNNNN.safetensors` per input file,
its samples concatenated (`input_ids`, `loss_mask`) with `offsets` `[n+1]` and their ids in the metadata."""

import json
from collections.abc import Iterator

from draftsmith.core import storage, tensorio
from draftsmith.core.manifest import StageManifest


def read_token_shard(data: bytes) -> list[dict]:
    """Inverse of `pack_shard`: a list of `{id, category, input_ids [S] int64, loss_mask [S] bool}`."""
    tensors, meta = tensorio.loads(data)
    ids, cats, off = json.loads(meta["ids"]), json.loads(meta["categories"]), tensors["offsets"].tolist()
    return [
        {
            "id": ids[i],
            "category": cats[i],
            "input_ids": tensors["input_ids"][off[i] : off[i + 1]].long(),
            "loss_mask": tensors["loss_mask"][off[i] : off[i + 1]].bool(),
        }
        for i in range(len(ids))
    ]


def token_samples(tokens: StageManifest) -> Iterator[dict]:
    """Every tokenized sample, shard by shard, in a fixed order (resume relies on it)."""
    for name in tokens.names("tokens-"):
        yield from read_token_shard(storage.read_bytes(tokens.path(name)))
