"""Online hidden-state streaming: producers put wire tensors into Mooncake, metadata goes on a JSON queue.

Producer (`MooncakeProducer`, one per target engine): `encode(sample, codec)` gives the wire tensors; their raw
bytes are copied into one registered staging buffer and put with one `batch_put_from`, one Mooncake key per
wire tensor, `{run}/{producer}/{seq}/{sample_id}/{tensor}`, hard-pinned so that Mooncake never evicts an
unconsumed sample. Only then does the sample record `{type: sample, seq, id, keys: {tensor: {key, shape,
dtype, nbytes}}}` go on the metadata queue (`draftsmith.transport.meta_queue`), so a record always points at data that
is there. A full store (rc -200) is back-pressure: the producer retries the keys that failed with
exponential backoff up to `full_timeout_s`, then raises naming the key and its bytes. A heartbeat thread
sends `{type: heartbeat}` every `heartbeat_s`; `close()` sends `{type: end, count, full_waits, full_wait_s}`.

Consumer (`MooncakeStream`, the trainer): listens on the queue, and for each record gets the tensors with one
`batch_get_into`, views the bytes with the recorded dtype and shape (bitwise: bf16 and fp8 are never
converted), force-removes the keys, and yields `decode(id, wire, codec)`. It stops once `num_producers`
producers have sent end-of-stream and every record before it was consumed. It raises `StreamError`, never
hangs, when a producer's connection drops without end-of-stream, when a producer is silent (heartbeats
included) for `peer_timeout_s`, when fewer than `num_producers` connect within `connect_timeout_s`, on a
duplicate or missing (producer, seq), and when a key cannot be read.

The master holds every key's location: when it dies, the samples announced and not yet read go with it. Both
ends then raise `MasterLost` naming its address and what was lost, not a key's bare rc: at once when a call
fails (or a producer drops out) while it refuses connections, else once the consumer's probe has found it
refusing for `master_timeout_s`.

Memory: whoever lends `global_segment_bytes` holds the data. Producers should lend 0 and the consumer (or a
`mooncake_client` memory holder) lend the pool, so a sample announced before a producer dies is still
readable. Shape legend: see `draftsmith.transport.sample`.
"""

import argparse
import dataclasses
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch

from draftsmith.transport.meta_queue import Event, MetaQueueClient, MetaQueueServer, QueueClosed, parse_addr
from draftsmith.transport.mooncake_store import NO_AVAILABLE_HANDLE, MooncakeSettings, connect, master_answers
from draftsmith.transport.sample import HiddenSample, StoreCodec, decode, encode

ALIGN = 64  # byte alignment of each tensor inside a staging buffer, so every dtype view is aligned
DTYPES = {
    name: getattr(torch, name)
    for name in ("bfloat16", "float16", "float32", "float64", "float8_e4m3fn", "int32", "int64", "uint8", "bool")
}


class StreamError(RuntimeError):
    """The stream cannot continue: a producer died or went silent, a record repeated, or data is missing."""


class MasterLost(StreamError):
    """The Mooncake master stopped answering: the samples announced and not yet read were lost with it."""


MASTER_PROBE_S, SETTLE_S = 1.0, 1.0  # probe period; how long after a failed call the master must keep answering


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def wire_key(run_id: str, producer_id: str, seq: int, sample_id: str, tensor: str) -> str:
    """The Mooncake key of one wire tensor of one sample."""
    return f"{run_id}/{producer_id}/{seq}/{sample_id}/{tensor}"


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype} cannot travel on the Mooncake stream (known: {sorted(DTYPES)})")
    return name


class _Staging:
    """A host buffer registered with the store for zero-copy `batch_put_from` / `batch_get_into`; grows."""

    def __init__(self, store, nbytes: int = 1 << 20):
        self.store = store
        self.buf = torch.empty(0, dtype=torch.uint8)
        self.ensure(nbytes)

    def ensure(self, nbytes: int) -> torch.Tensor:
        if nbytes > self.buf.numel():
            self.close()
            self.buf = torch.empty(max(nbytes, 2 * self.buf.numel()), dtype=torch.uint8)
            rc = self.store.register_buffer(self.buf.data_ptr(), self.buf.numel())
            if rc != 0:
                raise StreamError(f"register_buffer of a {self.buf.numel()}-byte staging buffer failed: rc={rc}")
        return self.buf

    def close(self) -> None:
        if self.buf.numel():
            self.store.unregister_buffer(self.buf.data_ptr())
            self.buf = torch.empty(0, dtype=torch.uint8)


class MooncakeProducer:
    """Puts `HiddenSample`s into Mooncake and announces them on the queue at `queue_addr` ("host:port")."""

    def __init__(
        self,
        settings: MooncakeSettings,
        queue_addr: str,
        codec: StoreCodec,
        run_id: str,
        *,
        producer_id: str | None = None,
        heartbeat_s: float = 1.0,
        full_timeout_s: float = 120.0,
        store=None,
    ):
        from mooncake.store import ReplicateConfig

        self.codec, self.run_id, self.full_timeout_s = codec, run_id, full_timeout_s
        self.master_addr = settings.master_addr
        self.producer_id = producer_id or f"{socket.gethostname()}-{os.getpid()}"
        self.seq = 0
        self.full_waits, self.full_wait_s = 0, 0.0
        try:
            self._queue = MetaQueueClient(queue_addr, send_timeout_s=max(10.0, 10 * heartbeat_s))
        except QueueClosed as e:
            raise StreamError(f"producer {self.producer_id}: {e}") from e
        self._owns_store = store is None
        try:
            self.store = connect(settings) if store is None else store
        except ConnectionError:
            self._queue.close()  # the consumer sees a disconnect before hello, and raises
            raise
        self._cfg = ReplicateConfig()
        self._cfg.with_hard_pin = True  # an evicted unconsumed sample would be silently lost
        self._staging = _Staging(self.store)
        self._error: QueueClosed | None = None
        self._stop = threading.Event()
        self._send({"type": "hello", "producer": self.producer_id, "run": run_id, "codec": dataclasses.asdict(codec)})
        self._heartbeat = threading.Thread(target=self._beat, args=(heartbeat_s,), daemon=True, name="mc-heartbeat")
        self._heartbeat.start()

    def _beat(self, period_s: float) -> None:
        while not self._stop.wait(period_s):
            try:
                self._queue.send({"type": "heartbeat"})
            except QueueClosed as e:
                self._error = e
                return

    def _send(self, body: dict) -> None:
        try:
            self._queue.send(body)
        except QueueClosed as e:
            raise StreamError(f"producer {self.producer_id}: {e} (at seq {self.seq})") from e

    def _check_consumer(self) -> None:
        if self._error is not None or self._queue.peer_closed():
            raise StreamError(
                f"producer {self.producer_id}: the consumer at {self._queue.addr} went away (seq {self.seq})"
            )

    def put(self, sample: HiddenSample) -> None:
        """Store `sample`'s wire tensors, then announce it; raises `StreamError` on a dead consumer or full store."""
        self.put_wire(sample.id, encode(sample, self.codec))

    def put_wire(self, sid: str, wire: dict[str, torch.Tensor]) -> None:
        """`put` for tensors already encoded with this producer's codec (e.g. read from the offline store)."""
        self._check_consumer()
        meta: dict[str, dict[str, Any]] = {}
        offset = 0
        for name, t in wire.items():
            nbytes = t.numel() * t.element_size()
            key = wire_key(self.run_id, self.producer_id, self.seq, sid, name) if nbytes else None
            meta[name] = {"key": key, "shape": list(t.shape), "dtype": dtype_name(t.dtype), "nbytes": nbytes}
            meta[name]["offset"], offset = offset, offset + _aligned(nbytes)
        buf = self._staging.ensure(offset)
        for name, t in wire.items():
            m = meta[name]
            buf[m["offset"] : m["offset"] + m["nbytes"]].copy_(t.contiguous().view(-1).view(torch.uint8))
        puts = [(m["key"], buf.data_ptr() + m.pop("offset"), m["nbytes"]) for m in meta.values()]
        stored = [p for p in puts if p[0] is not None]
        self._put_all(stored, sid)
        try:
            self._send({"type": "sample", "seq": self.seq, "id": sid, "keys": meta})
        except StreamError:
            self.store.batch_remove([p[0] for p in stored], True)
            raise
        self.seq += 1

    def _put_all(self, puts: list[tuple[str, int, int]], sid: str) -> None:
        """`batch_put_from` every (key, ptr, nbytes), retrying store-full keys with backoff until the deadline."""
        pending, done, delay = puts, [], 0.005
        deadline = time.monotonic() + self.full_timeout_s
        while pending:
            rcs = self.store.batch_put_from(
                [p[0] for p in pending], [p[1] for p in pending], [p[2] for p in pending], self._cfg
            )
            failed = [(p, rc) for p, rc in zip(pending, rcs, strict=True) if rc != 0]
            done += [p for p, rc in zip(pending, rcs, strict=True) if rc == 0]
            hard = [(p, rc) for p, rc in failed if rc != NO_AVAILABLE_HANDLE]
            if hard or (failed and time.monotonic() > deadline):
                (key, _, nbytes), rc = (hard or failed)[0]
                if hard and (down := master_answers(self.master_addr, settle_s=SETTLE_S)) is not None:
                    raise MasterLost(
                        f"producer {self.producer_id}: the Mooncake master at {self.master_addr} stopped answering "
                        f"({down}; put of {key} returned rc={rc}): sample {sid} (seq {self.seq}) and the rest "
                        "of this producer's share were not streamed"
                    )
                self.store.batch_remove([p[0] for p in done], True)
                why = f"rc={rc}" if hard else f"store still full (rc={rc}) after {self.full_timeout_s:.0f} s"
                raise StreamError(f"producer {self.producer_id}: put of {key} ({nbytes} bytes, sample {sid}): {why}")
            if failed:
                self.full_waits += 1
                time.sleep(delay)
                self.full_wait_s += delay
                delay = min(2 * delay, 0.25)
                self._check_consumer()
            pending = [p for p, _ in failed]

    def close(self) -> None:
        """Send end-of-stream with the count produced, then disconnect."""
        try:
            self._check_consumer()
            self._send(
                {"type": "end", "count": self.seq, "full_waits": self.full_waits, "full_wait_s": self.full_wait_s}
            )
        finally:
            self.abort()

    def abort(self) -> None:
        """Disconnect without end-of-stream: the consumer will raise `StreamError` for this producer."""
        self._stop.set()
        self._queue.close()
        self._staging.close()
        if self._owns_store:
            self.store.close()
            self._owns_store = False

    def __enter__(self) -> "MooncakeProducer":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.abort() if exc_type is not None else self.close()


@dataclass
class _Peer:
    name: str
    address: str
    last_seen: float
    seqs: set[int] = field(default_factory=set)
    last_seq: int | None = None
    ended: bool = False


class MooncakeStream:
    """Yields the `HiddenSample`s that `num_producers` producers send to this consumer's queue.

    `address` ("host:port") is what producers connect to. Use once, as a context manager or with `close()`.
    With `master_timeout_s` None the master is probed only when a call or a producer fails.
    """

    def __init__(
        self,
        settings: MooncakeSettings,
        listen_addr: str = "127.0.0.1:0",
        codec: StoreCodec | None = None,
        *,
        num_producers: int = 1,
        peer_timeout_s: float,
        connect_timeout_s: float = 120.0,
        master_timeout_s: float | None = None,
        store=None,
    ):
        if num_producers < 1:
            raise ValueError(f"num_producers must be >= 1, got {num_producers}")
        self.codec, self.num_producers = codec or StoreCodec(), num_producers
        self.peer_timeout_s, self.connect_timeout_s = peer_timeout_s, connect_timeout_s
        self.master_addr, self.master_timeout_s = settings.master_addr, master_timeout_s
        self._probed, self._lost = 0.0, False
        self._master_down: tuple[float, str] | None = None  # (since, why) while the master is down
        self._reading: tuple[str, int] | None = None  # the record being fetched: (producer, seq)
        self._owns_store = store is None
        # When this client lends the memory, unconsumed objects live in its segment and go with it.
        self._lends_memory = store is None and settings.global_segment_bytes > 0
        self.store = connect(settings) if store is None else store
        self._staging = _Staging(self.store)
        self._server = MetaQueueServer(*parse_addr(listen_addr))
        self.address = self._server.address
        self._peers: dict[int, _Peer] = {}  # by connection
        self._names: dict[str, _Peer] = {}
        self.producer_stats: dict[str, dict] = {}  # each producer's end-of-stream record
        self.consumed = 0
        self._started = time.monotonic()

    def __iter__(self) -> Iterator[HiddenSample]:
        try:
            while sum(p.ended for p in self._names.values()) < self.num_producers:
                event = self._server.get(timeout=0.1)
                self._check_liveness(event.t if event else time.monotonic())
                self._check_master(time.monotonic())
                if event is None:
                    continue
                sample = self._handle(event)
                if sample is not None:
                    self.consumed += 1
                    yield sample
        except MasterLost:
            raise
        except StreamError as e:
            # A failed get, or a producer that died of a failed put: a dead master explains both.
            if (down := master_answers(self.master_addr, settle_s=SETTLE_S)) is None:
                raise
            raise self._master_lost(down, first_sign=str(e)) from None

    def _check_master(self, now: float) -> None:
        """Probe the master every `MASTER_PROBE_S`; raise once it has refused connections for `master_timeout_s`."""
        if self.master_timeout_s is None or now - self._probed < MASTER_PROBE_S:
            return
        self._probed = now
        if (down := master_answers(self.master_addr)) is None:
            self._master_down = None
            return
        since = self._master_down[0] if self._master_down else now
        self._master_down = (since, down)
        if now - since >= self.master_timeout_s:
            raise self._master_lost(f"{down} for {now - since:.1f} s, master_timeout_s={self.master_timeout_s:g}")

    def _master_lost(self, why: str, first_sign: str | None = None) -> MasterLost:
        """The error for a dead master: its address, and which announced samples were lost with it."""
        self._lost = True
        unread: dict[str, list[int]] = {}
        if self._reading is not None:
            unread.setdefault(self._reading[0], []).append(self._reading[1])
        while (ev := self._server.get_nowait()) is not None:
            if ev.kind == "message" and ev.message.get("type") == "sample" and isinstance(ev.message.get("seq"), int):
                name = self._peers[ev.conn].name if ev.conn in self._peers else f"a producer at {ev.peer}"
                unread.setdefault(name, []).append(ev.message["seq"])
        # A producer's unread records are consecutive: it announces in order and the queue keeps it.
        which = "; ".join(f"{n} seq {min(q)}" + (f"-{max(q)}" if len(q) > 1 else "") for n, q in sorted(unread.items()))
        count = sum(len(seqs) for seqs in unread.values())
        lost = f"{count} announced samples not yet read were lost with it ({which})" if count else ""
        message = (
            f"the Mooncake master at {self.master_addr} stopped answering ({why}): {lost or 'no sample was unread'}"
            f", and no more can be streamed; {self.consumed} samples had been read"
        )
        return MasterLost(message + (f". First sign: {first_sign}" if first_sign else ""))

    def _check_liveness(self, now: float) -> None:
        """Raise if a live producer was silent for `peer_timeout_s`, or too few connected in time."""
        for p in self._peers.values():
            if not p.ended and now - p.last_seen > self.peer_timeout_s:
                raise StreamError(
                    f"producer {p.name} ({p.address}) sent nothing, not even a heartbeat, for "
                    f"{now - p.last_seen:.1f} s (peer_timeout_s={self.peer_timeout_s}); last seq {p.last_seq}"
                )
        if len(self._names) < self.num_producers and now - self._started > self.connect_timeout_s:
            raise StreamError(
                f"only {len(self._names)} of {self.num_producers} producers connected to {self.address} "
                f"within {self.connect_timeout_s:.0f} s: {sorted(self._names)}"
            )

    def _handle(self, ev: Event) -> HiddenSample | None:
        peer = self._peers.get(ev.conn)
        if ev.kind == "closed":
            if peer is None or not peer.ended:
                who = f"producer {peer.name} ({ev.peer})" if peer else f"a producer at {ev.peer} (before hello)"
                last = peer.last_seq if peer else None
                raise StreamError(f"{who} disconnected without end-of-stream ({ev.body}); last seq {last}")
            return None
        kind = ev.message.get("type")
        if peer is None:
            if kind != "hello":
                self._bad(ev, "first message is not hello")
            self._hello(ev)
            return None
        peer.last_seen = ev.t
        if kind == "heartbeat":
            return None
        if kind == "sample":
            return self._sample(peer, ev.message)
        if kind == "end":
            if ev.message.get("count") != len(peer.seqs):
                raise StreamError(
                    f"producer {peer.name} ended with count {ev.message.get('count')} but {len(peer.seqs)} records "
                    f"arrived; last seq {peer.last_seq}"
                )
            peer.ended = True
            self.producer_stats[peer.name] = dict(ev.message)
            return None
        self._bad(ev, f"unknown message type {kind!r}")

    def _bad(self, ev: Event, why: str) -> NoReturn:
        raise StreamError(f"bad message from {ev.peer}: {why}: {json.dumps(ev.body)[:200]}")

    def _hello(self, ev: Event) -> None:
        name = ev.message.get("producer")
        if not isinstance(name, str) or name in self._names:
            self._bad(ev, f"producer name {name!r} is missing or already connected")
        codec = ev.message.get("codec")
        if codec != dataclasses.asdict(self.codec):
            self._bad(ev, f"producer {name} codec {codec} differs from the consumer's {dataclasses.asdict(self.codec)}")
        if len(self._names) >= self.num_producers:
            self._bad(ev, f"producer {name} is one more than num_producers={self.num_producers}")
        self._peers[ev.conn] = self._names[name] = _Peer(name=name, address=ev.peer, last_seen=ev.t)

    def _sample(self, peer: _Peer, rec: dict) -> HiddenSample:
        seq = rec.get("seq")
        if not isinstance(seq, int) or seq in peer.seqs:
            raise StreamError(f"producer {peer.name}: duplicate or invalid seq {seq!r} (last seq {peer.last_seq})")
        peer.seqs.add(seq)
        peer.last_seq = seq
        self._reading = (peer.name, seq)
        if self._master_down is not None and (down := master_answers(self.master_addr)) is not None:
            raise self._master_lost(down)  # a get would fail too, but only after Mooncake's seconds of retries
        wire = self._fetch(peer, rec)
        self._reading = None
        return decode(rec["id"], wire, self.codec)

    def _fetch(self, peer: _Peer, rec: dict) -> dict[str, torch.Tensor]:
        """Get every wire tensor of one record (one `batch_get_into`), then force-remove its keys."""
        metas, offsets, total = rec["keys"], {}, 0
        for name, m in metas.items():
            if m["dtype"] not in DTYPES:
                raise StreamError(f"producer {peer.name} seq {rec['seq']}: {name} has unknown dtype {m['dtype']!r}")
            offsets[name], total = total, total + _aligned(m["nbytes"])
        buf = self._staging.ensure(total)
        stored = [(m["key"], buf.data_ptr() + offsets[n], m["nbytes"]) for n, m in metas.items() if m["key"]]
        rcs = self.store.batch_get_into([s[0] for s in stored], [s[1] for s in stored], [s[2] for s in stored])
        for (key, _, nbytes), rc in zip(stored, rcs, strict=True):
            if rc != nbytes:
                raise StreamError(
                    f"producer {peer.name} seq {rec['seq']}: get of {key} returned {rc}, expected {nbytes} bytes"
                )
        blob = buf[:total].clone()  # one copy frees the staging buffer; the tensors are views of it
        wire = {}
        for name, m in metas.items():
            raw = blob[offsets[name] : offsets[name] + m["nbytes"]]
            wire[name] = raw.view(DTYPES[m["dtype"]]).reshape(m["shape"])
        for (key, _, _), rc in zip(stored, self.store.batch_remove([s[0] for s in stored], True), strict=True):
            if rc != 0:
                raise StreamError(f"producer {peer.name} seq {rec['seq']}: remove of {key} failed with rc={rc}")
        return wire

    def close(self, *, disconnect: bool = True) -> None:
        """Stop listening; drop the records that arrived but were not consumed.

        Their objects live in the segment this consumer lends, and unmounting it on close drops them, so
        they are not removed one by one: `batch_remove` while a live producer is still putting into the
        same segment crashed Mooncake 0.3.13 (SIGSEGV, about one run in three on 2 loaded cores). Only a
        consumer that lends nothing (another client holds the memory) removes them. `disconnect=False`
        leaves the store client to the process's exit, for a process that exits without finalizing after
        `MasterLost`: closing a client of a dead master holds the GIL through ~11 s of retries.
        """
        self._server.close()
        leftovers = []
        while (ev := self._server.get_nowait()) is not None:
            if ev.kind == "message" and ev.message.get("type") == "sample":
                leftovers += [m["key"] for m in ev.message.get("keys", {}).values() if m.get("key")]
        if leftovers and not self._lends_memory and not self._lost:
            self.store.batch_remove(leftovers, True)
        self._staging.close()
        if self._owns_store and disconnect:
            self.store.close()
            self._owns_store = False

    def __enter__(self) -> "MooncakeStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def produce_offline_store(settings: MooncakeSettings, queue_addr: str, store_uri: str, run_id: str, **kw) -> int:
    """Replay every sample of a finished offline store into the stream, bytes as stored; returns the count."""
    from draftsmith.transport.offline_reader import OfflineDataset

    dataset = OfflineDataset(store_uri)
    with MooncakeProducer(settings, queue_addr, dataset.info.codec, run_id, **kw) as producer:
        for i, sid in enumerate(dataset.ids):
            producer.put_wire(sid, dataset.wire(i))
    return len(dataset)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m draftsmith.transport.mooncake_stream", description="Mooncake stream tools"
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("produce", help="stream a finished offline hidden-state store to a consumer")
    p.add_argument("--settings", required=True, help="MooncakeSettings as JSON (dataclasses.asdict)")
    p.add_argument("--queue", required=True, help="the consumer's metadata queue, HOST:PORT")
    p.add_argument("--store", required=True, help="offline store URI (a folder or s3://...)")
    p.add_argument("--run-id", required=True, help="key prefix; unique per run")
    p.add_argument("--producer-id", default=None, help="default: HOSTNAME-PID")
    a = ap.parse_args(argv)
    settings = MooncakeSettings(**json.loads(a.settings))
    try:
        n = produce_offline_store(settings, a.queue, a.store, a.run_id, producer_id=a.producer_id)
    except StreamError as e:
        sys.stderr.write(f"StreamError: {e}\n")
        return 3
    sys.stdout.write(json.dumps({"produced": n}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
