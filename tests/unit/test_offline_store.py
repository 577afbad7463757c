"""The offline store: shards of many samples, index and dataset.json, commit-then-index, resume, reads."""

import json
from typing import Any

import fsspec
import pytest

from draftsmith.core import storage
from draftsmith.transport import offline_reader
from draftsmith.transport.offline_reader import OfflineDataset, PrefetchLoader
from draftsmith.transport.offline_store import COMMITS, ShardWriter, shard_name, write_store
from draftsmith.transport.sample import StoreCodec, decode, encode
from tests.support.runs import STORE_TAPS as TAPS
from tests.support.runs import assert_same_sample, store_info, store_samples

pytestmark = pytest.mark.unit


CODECS = [
    StoreCodec("bfloat16", "all", TAPS),
    StoreCodec("fp8_e4m3", "supervised", TAPS),
    StoreCodec("float32", "supervised", TAPS),
]


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: f"{c.dtype}-{c.positions}")
@pytest.mark.parametrize("where", ["local", "memory"])
def test_every_sample_reads_back_exactly_as_encoded(tmp_path, codec, where):
    uri = str(tmp_path / "store") if where == "local" else f"memory://store-{codec.dtype}-{codec.positions}"
    data = store_samples(11)
    dataset = write_store(uri, store_info(codec), data, shard_samples=4)
    assert [s["samples"] for s in dataset["shards"]] == [4, 4, 3]
    assert dataset["samples"] == 11 and dataset["tokens"] == sum(len(s.input_ids) for s in data)
    ds = OfflineDataset(uri)
    assert (
        ds.info.codec == codec and ds.info.tokenizer_sha256 == "abc" and ds.lengths == [len(s.input_ids) for s in data]
    )
    for i, s in enumerate(data):
        assert_same_sample(ds[i], decode(s.id, encode(s, codec), codec))
    ds.verify()
    index = storage.read_jsonl(storage.join(uri, "index.jsonl"))
    assert index[5]["shard"] == shard_name(1) and index[5]["row"] == 1
    assert index[5]["loss_tokens"] == int(data[5].loss_mask.sum())
    if where == "memory":
        fsspec.filesystem("memory").rm(uri.removeprefix("memory://"), recursive=True)


def test_ranged_reads_fetch_only_the_sample(monkeypatch):
    uri = "memory://ranged"
    data = store_samples(9, seed=3)
    write_store(uri, store_info(CODECS[0]), data, shard_samples=9)
    fetched: list[Any] = []
    real = storage.read_ranges

    def spy(url, ranges):
        fetched.extend(e - s for s, e in ranges)
        return real(url, ranges)

    monkeypatch.setattr(offline_reader.storage, "read_ranges", spy)
    ds = OfflineDataset(uri)
    sample = ds[4]
    shard_bytes = storage.size(storage.join(uri, shard_name(0)))
    wire = encode(data[4], CODECS[0])
    wide = sum(wire[n].numel() * wire[n].element_size() for n in ("hidden_states", "last_hidden"))
    # ids and mask (5 bytes a token) come whole, once per shard: requests, not bytes, bound object stores.
    small = sum(len(s.input_ids) for s in data) * (4 + 1)
    header = fetched[0] + fetched[1]
    assert sum(fetched) - header == wide + small < shard_bytes / 4
    fetched.clear()
    ds[5]
    assert sum(fetched) == sum(encode(data[5], CODECS[0])[n].nbytes for n in ("hidden_states", "last_hidden"))
    assert_same_sample(sample, decode(data[4].id, encode(data[4], CODECS[0]), CODECS[0]))
    fsspec.filesystem("memory").rm("/ranged", recursive=True)


def test_resume_continues_after_the_last_committed_shard_and_ignores_a_partial_one(tmp_path):
    uri, codec = str(tmp_path / "store"), CODECS[1]
    data = store_samples(10, seed=1)
    one_shot = write_store(str(tmp_path / "ref"), store_info(codec), data, shard_samples=3)

    writer = ShardWriter(uri, store_info(codec), 3)
    for s in data[:7]:  # shards 0 and 1 committed, one sample pending: the process "dies" here
        writer.add(s)
    storage.write_bytes(storage.join(uri, shard_name(2)), b"torn shard from a crash before its commit")
    resumed = ShardWriter(uri, store_info(codec), 3)
    assert resumed.committed_samples == 6 and not storage.exists(storage.join(uri, COMMITS, "00002.json"))
    for s in data[resumed.committed_samples :]:
        resumed.add(s)
    dataset = resumed.finish()
    assert [s["sha256"] for s in dataset["shards"]] == [s["sha256"] for s in one_shot["shards"]]
    OfflineDataset(uri).verify()


def test_a_gap_in_commits_and_corruption_are_named(tmp_path):
    uri = str(tmp_path / "store")
    write_store(uri, store_info(CODECS[0]), store_samples(6), shard_samples=2)
    blob = bytearray(storage.read_bytes(storage.join(uri, shard_name(1))))
    blob[-1] ^= 0xFF
    storage.write_bytes(storage.join(uri, shard_name(1)), bytes(blob))
    with pytest.raises(ValueError, match=r"shard-00001\.safetensors: \S+ [0-9a-f]+… where [0-9a-f]+… was recorded"):
        OfflineDataset(uri).verify()
    storage.remove_tree(storage.join(uri, COMMITS, "00001.json"))
    with pytest.raises(ValueError, match="shard 1 is missing but shard 2 is committed"):
        ShardWriter(uri, store_info(CODECS[0]), 2)
    with pytest.raises(FileNotFoundError, match="no dataset.json"):
        OfflineDataset(str(tmp_path / "nowhere"))
    meta = json.loads(storage.read_bytes(storage.join(uri, "dataset.json")))
    storage.write_json(storage.join(uri, "dataset.json"), meta | {"version": 1})
    with pytest.raises(ValueError, match="format version 1"):
        OfflineDataset(uri)


def test_prefetch_loader_yields_the_planned_batches_in_order(tmp_path):
    uri = str(tmp_path / "store")
    data = store_samples(12, seed=2)
    write_store(uri, store_info(CODECS[0]), data, shard_samples=5)
    ds = OfflineDataset(uri)
    plan = [[3, 0], [11], [5, 6, 7], [1, 2, 4, 8, 9, 10]]
    got = list(PrefetchLoader(ds, plan, workers=2, prefetch=2))
    assert [[s.id for s in b] for b in got] == [[f"row-{i}" for i in b] for b in plan]
    for batch, idx in zip(got, plan, strict=True):
        for s, i in zip(batch, idx, strict=True):
            assert_same_sample(s, ds[i])
