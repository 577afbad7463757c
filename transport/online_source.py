"""The trainer's end of online hidden-state streaming.

`OnlineSource` starts a Mooncake master when the recipe names none, opens the stream (the trainer lends the
store its memory, so `segment_mb` bounds what is in flight), starts the local producers (each runs the
producer module it is given, `python -m <module> --spec FILE`, with a `ProducerSpec`), and on failure names
each producer's exit code and log tail. A dead Mooncake master fails the stream with one `MasterLost` naming
it and the samples lost; the producers' logs would only repeat that. Local producers and the master die with
the process that started them, even when it is SIGKILLed.
"""

import json
import logging
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from draftsmith.core import procs
from draftsmith.core.config import HiddenStatesConfig, TargetConfig
from draftsmith.core.manifest import StageManifest
from draftsmith.transport.mooncake_store import MooncakeMaster, MooncakeSettings, stop_process
from draftsmith.transport.mooncake_stream import MasterLost, MooncakeStream, StreamError
from draftsmith.transport.sample import HiddenSample, StoreCodec

log = logging.getLogger(__name__)


def codec_of(cfg: HiddenStatesConfig) -> StoreCodec:
    return StoreCodec(dtype=cfg.store_dtype, positions=cfg.positions, num_taps=len(cfg.taps))


@dataclass
class ProducerSpec:
    """Everything one producer process needs, as JSON."""

    hidden: dict
    target: dict
    tokens: dict
    settings: dict
    queue: str
    run_id: str
    epochs: int = 1
    index: int = 0
    count: int = 1


def producer_settings(cfg: HiddenStatesConfig, master: MooncakeMaster | None) -> MooncakeSettings:
    """A producer's client settings: it lends no memory, so data it announced outlives it."""
    o = cfg.online
    master_addr = master.master_addr if master else o.master_addr
    metadata_url = master.metadata_url if master else o.metadata_url
    if master_addr is None or metadata_url is None:
        raise ValueError("hidden_states.online.master_addr and metadata_url: required when no master is started")
    return MooncakeSettings(
        master_addr=master_addr,
        metadata_url=metadata_url,
        local_hostname=o.local_hostname,
        global_segment_bytes=0,
        protocol=o.protocol,
        device=o.device,
    )


class OnlineSource:
    """The trainer's end of the stream, with the master and local producers it owns. Use as a context manager."""

    def __init__(
        self,
        cfg: HiddenStatesConfig,
        target: TargetConfig,
        tokens: StageManifest,
        *,
        epochs: int,
        run_id: str,
        producer_module: str,
    ):
        """`producer_module` is run as `python -m <module> --spec FILE` for each local producer."""
        self.cfg, self.target, self.tokens, self.epochs, self.run_id = cfg, target, tokens, epochs, run_id
        self.producer_module = producer_module
        self.dir = Path(tempfile.mkdtemp(prefix=f"online-{run_id}-"))
        self.master: MooncakeMaster | None = None
        self.stream: MooncakeStream | None = None
        self.procs: list[tuple[subprocess.Popen, Path]] = []
        self.master_lost = False

    def __enter__(self) -> "OnlineSource":
        o = self.cfg.online
        try:
            if o.master_addr is None:
                self.master = MooncakeMaster(log_dir=self.dir).start()
            settings = producer_settings(self.cfg, self.master).replace(global_segment_bytes=o.segment_mb << 20)
            self.stream = MooncakeStream(
                settings,
                o.queue_addr,
                codec_of(self.cfg),
                num_producers=o.num_producers,
                peer_timeout_s=o.peer_timeout_s,
                master_timeout_s=o.master_timeout_s,
            )
            if o.producers == "local":
                for index in range(o.num_producers):
                    self.procs.append(self._spawn(index))
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _spawn(self, index: int) -> tuple[subprocess.Popen, Path]:
        assert self.stream is not None
        spec = ProducerSpec(
            hidden=self.cfg.model_dump(mode="json"),
            target=self.target.model_dump(mode="json"),
            tokens=self.tokens.model_dump(mode="json"),
            settings=producer_settings(self.cfg, self.master).to_json_dict(),
            queue=self.stream.address,
            run_id=self.run_id,
            epochs=self.epochs,
            index=index,
            count=self.cfg.online.num_producers,
        )
        spec_path, log_path = self.dir / f"producer-{index}.json", self.dir / f"producer-{index}.log"
        spec_path.write_text(json.dumps(asdict(spec)))
        with open(log_path, "wb") as fh:
            cmd = [sys.executable, "-m", self.producer_module, "--spec", str(spec_path)]
            # An orphaned producer would hold its engine (a GPU) until it next talks to the queue; the thread
            # that starts it also stops it in __exit__, so it may arm the death signal.
            proc = subprocess.Popen(
                cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                **procs.popen_kwargs(caller_waits=True),
            )  # fmt: skip
        log.info("online: producer %d started (pid %d, log %s)", index, proc.pid, log_path)
        return proc, log_path

    def samples(self) -> Iterator[HiddenSample]:
        """Every streamed sample, in arrival order; a dead producer raises `StreamError` with its log tail."""
        assert self.stream is not None
        try:
            yield from self.stream
        except MasterLost:
            self.master_lost = True
            raise
        except StreamError as e:
            raise StreamError(f"{e}{self._producer_report()}") from e
        for proc, _ in self.procs:
            if proc.wait(timeout=120) != 0:
                raise StreamError(f"producer exited {proc.returncode} after end-of-stream{self._producer_report()}")

    def _producer_report(self) -> str:
        lines = []
        for i, (proc, log_path) in enumerate(self.procs):
            try:
                proc.wait(timeout=10)  # a producer that just broke is usually still exiting
            except subprocess.TimeoutExpired:
                pass
            tail = log_path.read_text(errors="replace")[-4000:] if log_path.exists() else ""
            lines.append(f"\n--- producer {i} (exit {proc.poll()}, {log_path}):\n{tail}")
        return "".join(lines)

    def __exit__(self, *exc: object) -> None:
        for proc, _ in self.procs:
            stop_process(proc)
        if self.stream is not None:
            # Its store client closes before the master stops; a dead master's is left to the rank's exit,
            # which skips finalizing (draftsmith.drafters.training.worker) rather than wait out Mooncake's retries.
            self.stream.close(disconnect=not self.master_lost)
        if self.master is not None:
            self.master.stop()
