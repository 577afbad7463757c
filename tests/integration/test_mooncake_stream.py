"""The Mooncake stream against a real `mooncake_master`, with the producer in its own process.

Proves: every sample arrives exactly once and bitwise equal to `decode(encode(sample))` (bf16, and fp8 with
supervised rows), its keys are gone from the store afterwards, a store smaller than the stream applies
back-pressure without loss, and a killed, frozen, or abandoned peer raises `StreamError` instead of hanging.
"""

import dataclasses
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from draftsmith.transport.mooncake_store import MooncakeMaster, stop_process
from draftsmith.transport.mooncake_stream import MooncakeStream, StreamError, wire_key
from draftsmith.transport.sample import StoreCodec, decode, encode

pytestmark = pytest.mark.integration

HELPER = Path(__file__).with_name("mooncake_producer_main.py")
_spec = importlib.util.spec_from_file_location("mooncake_producer_main", HELPER)
assert _spec is not None and _spec.loader is not None
producer_main = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(producer_main)

FIELDS = ("input_ids", "loss_mask", "hidden_states", "last_hidden")


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    with MooncakeMaster(log_dir=tmp_path_factory.mktemp("mooncake")) as m:
        yield m


def spawn_producer(master, stream, codec, tmp_path, run_id, **opts) -> subprocess.Popen:
    """The helper script as a child process; producers lend no memory, the consumer holds the pool."""
    args = [
        sys.executable,
        str(HELPER),
        f"--settings={json.dumps(dataclasses.asdict(master.settings(global_segment_bytes=0)))}",
        f"--queue={stream.address}",
        f"--codec={json.dumps(dataclasses.asdict(codec))}",
        f"--run-id={run_id}",
        f"--producer-id={run_id}-p0",
    ] + [f"--{k.replace('_', '-')}={v}" for k, v in opts.items()]
    log = open(tmp_path / f"{run_id}-producer.log", "wb")
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def expected(codec, seed, count, **shape):
    """What the offline store would hand the trainer for each sample: `decode(encode(sample))`."""
    out = []
    for i in range(count):
        s = producer_main.make_sample(seed, i, num_taps=codec.num_taps, **shape)
        out.append((s, decode(s.id, encode(s, codec), codec)))
    return out


def assert_bitwise(got, want):
    assert got.id == want.id
    for f in FIELDS:
        a, b = getattr(got, f), getattr(want, f)
        assert a.dtype == b.dtype and a.shape == b.shape, (got.id, f, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a, b), (got.id, f)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "codec",
    [StoreCodec("bfloat16", "all", num_taps=3), StoreCodec("fp8_e4m3", "supervised", num_taps=2)],
    ids=["bf16-all", "fp8-supervised"],
)
def test_every_sample_once_bitwise_and_keys_removed(master, tmp_path, codec):
    run_id, seed, count = f"run-{codec.dtype}", 7, 20
    shape = dict(hidden=64, min_len=5, max_len=80)
    settings = master.settings(global_segment_bytes=64 << 20)
    with MooncakeStream(settings, codec=codec, peer_timeout_s=10, connect_timeout_s=30) as stream:
        proc = spawn_producer(master, stream, codec, tmp_path, run_id, seed=seed, count=count, **shape)
        try:
            got = list(stream)
            assert proc.wait(timeout=20) == 0
            want = expected(codec, seed, count, **shape)
            assert [g.id for g in got] == [s.id for s, _ in want]  # once each, in order
            assert len({g.hidden_states.shape[0] for g in got}) > 5  # lengths really vary
            for g, (_, w) in zip(got, want, strict=True):
                assert_bitwise(g, w)
            keys = [
                wire_key(run_id, f"{run_id}-p0", i, s.id, n) for i, (s, _) in enumerate(want) for n in encode(s, codec)
            ]
            assert len(keys) == count * (6 if codec.dtype == "fp8_e4m3" else 4)
            assert [stream.store.is_exist(k) for k in keys] == [0] * len(keys)
            assert stream.producer_stats[f"{run_id}-p0"]["count"] == count
        finally:
            stop_process(proc)


@pytest.mark.timeout(60)
def test_back_pressure_when_the_store_is_smaller_than_the_stream(master, tmp_path):
    codec, run_id, seed, count = StoreCodec("bfloat16", "all", num_taps=3), "run-bp", 11, 24
    shape = dict(hidden=512, min_len=256, max_len=512)  # ~0.9-1.8 MiB a sample, ~32 MiB in all
    want = expected(codec, seed, count, **shape)
    total = sum(t.numel() * t.element_size() for s, _ in want for t in encode(s, codec).values())
    segment = 16 << 20
    assert total > 1.5 * segment
    settings = master.settings(global_segment_bytes=segment)
    with MooncakeStream(settings, codec=codec, peer_timeout_s=10, connect_timeout_s=30) as stream:
        proc = spawn_producer(master, stream, codec, tmp_path, run_id, seed=seed, count=count, **shape)
        try:
            got: list[Any] = []
            for s in stream:
                got.append(s)
                # A slow trainer: the producer outruns it and fills the store. The long first pause makes that
                # so on a loaded machine too, where producing a sample can take longer than 0.1 s.
                time.sleep(6.0 if len(got) == 1 else 0.1)
            assert proc.wait(timeout=20) == 0
        finally:
            stop_process(proc)
        assert [g.id for g in got] == [s.id for s, _ in want]
        for g, (_, w) in zip(got, want, strict=True):
            assert_bitwise(g, w)
        stats = stream.producer_stats[f"{run_id}-p0"]
        assert stats["count"] == count and stats["full_waits"] >= 1, stats


def _consume_until_error(stream, proc, act_after: int, act) -> tuple[int, str, float]:
    """Iterate; after `act_after` samples call `act(proc)`; return (consumed, error text, seconds to error)."""
    t_act = math.inf
    with pytest.raises(StreamError) as err:
        for i, _ in enumerate(stream):
            if i + 1 == act_after:
                act(proc)
                t_act = time.monotonic()
    return stream.consumed, str(err.value), time.monotonic() - t_act


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["killed", "frozen"])
def test_dead_or_silent_producer_raises(master, tmp_path, how):
    codec, run_id = StoreCodec(), f"run-{how}"
    settings = master.settings(global_segment_bytes=32 << 20)
    with MooncakeStream(settings, codec=codec, peer_timeout_s=2.0, connect_timeout_s=30) as stream:
        proc = spawn_producer(master, stream, codec, tmp_path, run_id, count=10, hang_after=4)
        sig = signal.SIGKILL if how == "killed" else signal.SIGSTOP
        try:
            consumed, text, waited = _consume_until_error(stream, proc, 2, lambda p: os.kill(p.pid, sig))
        finally:
            if how == "frozen":
                os.kill(proc.pid, signal.SIGCONT)
            stop_process(proc)
    assert f"{run_id}-p0" in text and "last seq" in text, text
    if how == "killed":
        assert "disconnected without end-of-stream" in text and waited < 5, (text, waited)
        assert consumed >= 2
    else:
        assert "not even a heartbeat" in text and 0.9 < waited < 6, (text, waited)


@pytest.mark.timeout(60)
def test_producer_raises_when_the_consumer_goes_away(master, tmp_path):
    codec, run_id = StoreCodec(), "run-gone"
    settings = master.settings(global_segment_bytes=32 << 20)
    stream = MooncakeStream(settings, codec=codec, peer_timeout_s=10, connect_timeout_s=30)
    proc = spawn_producer(master, stream, codec, tmp_path, run_id, count=100_000, min_len=2, max_len=4)
    try:
        for i, _ in enumerate(stream):
            if i == 3:
                break
        stream.close()
        assert proc.wait(timeout=20) == 3
        log = (tmp_path / f"{run_id}-producer.log").read_text()
        assert "StreamError" in log and "went away" in log, log[-2000:]
    finally:
        stop_process(proc)
        stream.close()


@pytest.mark.timeout(60)
def test_cli_replays_an_offline_store_bitwise(master, tmp_path):
    """`python -m draftsmith.transport.mooncake_stream produce --store URI` sends each sample's stored bytes
    unchanged."""
    from draftsmith.transport.offline_reader import OfflineDataset
    from draftsmith.transport.offline_store import StoreInfo, write_store

    codec = StoreCodec("fp8_e4m3", "supervised", num_taps=2)
    samples = [producer_main.make_sample(3, i, num_taps=2, hidden=64, min_len=5, max_len=40) for i in range(6)]
    info = StoreInfo(codec=codec, taps=[1, 2], hidden_size=64, target="synthetic")
    write_store(str(tmp_path / "store"), info, samples, shard_samples=4)
    offline = OfflineDataset(str(tmp_path / "store"))
    settings = master.settings(global_segment_bytes=32 << 20)
    with MooncakeStream(settings, codec=codec, peer_timeout_s=10, connect_timeout_s=30) as stream:
        args = [sys.executable, "-m", "draftsmith.transport.mooncake_stream", "produce", f"--queue={stream.address}"]
        args += [f"--settings={json.dumps(dataclasses.asdict(master.settings(global_segment_bytes=0)))}"]
        args += [f"--store={tmp_path / 'store'}", "--run-id=run-cli", "--producer-id=cli"]
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        try:
            got = list(stream)
            assert proc.wait(timeout=20) == 0
            assert proc.stdout is not None
            assert json.loads(proc.stdout.read()) == {"produced": 6}
        finally:
            stop_process(proc)
    assert [g.id for g in got] == offline.ids == [s.id for s in samples]
    for i, g in enumerate(got):
        assert_bitwise(g, offline[i])


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", ["duplicate", "count"])
def test_duplicate_seq_and_wrong_end_count_are_errors(master, case):
    """Exactly-once is enforced on (producer, seq): a replayed record, or an end count that disagrees, raises."""
    from draftsmith.transport.meta_queue import MetaQueueClient

    codec = StoreCodec()
    settings = master.settings(global_segment_bytes=16 << 20)
    sample = producer_main.make_sample(5, 0, num_taps=1, hidden=16, min_len=4, max_len=8)
    with MooncakeStream(settings, codec=codec, peer_timeout_s=10, connect_timeout_s=10) as stream:
        keys = {}
        for name, t in encode(sample, codec).items():  # what a producer would put, by hand
            key = wire_key(f"run-{case}", "fake", 0, sample.id, name)
            assert stream.store.put(key, t.contiguous().view(-1).view(torch.uint8).numpy()) == 0
            nbytes = t.numel() * t.element_size()
            keys[name] = {"key": key, "shape": list(t.shape), "dtype": str(t.dtype)[6:], "nbytes": nbytes}
        record = {"type": "sample", "seq": 0, "id": sample.id, "keys": keys}
        q = MetaQueueClient(stream.address)
        q.send({"type": "hello", "producer": "fake", "run": case, "codec": dataclasses.asdict(codec)})
        q.send(record)
        q.send(record if case == "duplicate" else {"type": "end", "count": 2})
        got: list[Any] = []
        with pytest.raises(StreamError, match="duplicate" if case == "duplicate" else "ended with count 2 but 1"):
            got.extend(stream)
        q.close()
    assert [g.id for g in got] == [sample.id]  # the first copy was delivered, intact
    assert_bitwise(got[0], decode(sample.id, encode(sample, codec), codec))
