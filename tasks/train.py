"""Stage 5: train the drafter on the captured hidden states with the FSDP2 trainer, launched by torchrun.

The task writes a job spec into the stage folder, runs `torchrun ... -m draftsmith.drafters.training.worker` with the
recipe's nodes, ranks and rendezvous (`drafters.training.torchrun` streams every rank's log into this task's log and
fails with the failing rank's traceback), and turns the `result.json` rank 0 wrote into the manifest. A
retried or re-run task with the same inputs resumes from the newest checkpoint in `<stage>/checkpoints`.

Progress (optimizer steps) is read in this process: the step count and resume point from the start line of
this node's first rank, the current step from its `train step N |` lines and, when the stage folder is local,
from the last record of `metrics.jsonl`, which rank 0 appends every step.
"""

import json
import logging
import re
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.exceptions import MissingContextError

from draftsmith.core import storage, tensorio, ui
from draftsmith.core.caching import stage_task
from draftsmith.core.config import DrafterConfig, HiddenStatesConfig, TargetConfig, TrainConfig
from draftsmith.core.manifest import FileEntry, StageManifest
from draftsmith.core.progress import MIN_INTERVAL_S, Progress, stage_progress
from draftsmith.core.stage import StageResult, run_stage, stage_key
from draftsmith.drafters import data, families
from draftsmith.drafters.export import serve
from draftsmith.drafters.training import checkpoint, fsdp, loop, plan, run, schedule, target_parts, torchrun, worker
from draftsmith.tasks import hidden_stream
from draftsmith.transport import offline_reader, sample
from draftsmith.transport.token_shards import token_samples

STAGE = "train"
CODE = [data, families, checkpoint, fsdp, loop, plan, run, schedule, target_parts, worker, offline_reader, sample]


def loss_token_counts(tokens: StageManifest, vocab_size: int) -> torch.Tensor:
    """How often each target id appears as a loss token `[V]`, over the tokenized corpus."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in token_samples(tokens):
        counts += torch.bincount(s["input_ids"][s["loss_mask"]], minlength=vocab_size)
    return counts


# What drafters/training prints (worker.main's start line, MetricsSink.write's step line), after torchrun's prefix.
_START_LINE = re.compile(r"train: rank \d+ of \d+, (\d+) steps, resuming at step (\d+)")
_STEP_LINE = re.compile(r"train step (\d+) \|")
_LOSS = re.compile(r"\bloss (\S+)")


def _logger() -> logging.Logger | logging.LoggerAdapter:
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("draftsmith.train")


class StepProgress(logging.LoggerAdapter):
    """The launcher's logger that also reads the trainer's step count and current step from the lines it logs."""

    def __init__(self, logger: logging.Logger | logging.LoggerAdapter, progress: Progress, max_steps: int | None):
        super().__init__(logger, {})
        self.progress = progress
        self.max_steps = max_steps

    def log(self, level: int, msg: object, *args: object, **kwargs: object) -> None:
        try:
            line = str(msg) % args if args else str(msg)
        except (TypeError, ValueError):  # logging reports its own formatting errors; reading must not raise
            line = str(msg)
        self.observe(line)
        self.logger.log(level, msg, *args, **kwargs)

    def observe(self, line: str) -> None:
        if start := _START_LINE.search(line):
            total = int(start[1])
            self.progress.set_total(min(total, self.max_steps) if self.max_steps else total)
            self.progress.update(int(start[2]))
        elif step := _STEP_LINE.search(line):
            if loss := _LOSS.search(line, step.end()):
                self.progress.note(f"loss {loss[1]}")  # before the step: the step's redraw shows it
            self.at_step(int(step[1]))

    def at_step(self, step: int) -> None:
        if step > self.progress.done:
            self.progress.update(step)


def last_step(path: Path) -> int | None:
    """The `step` of the last complete record of a metrics.jsonl being appended to (None: none yet)."""
    try:
        with path.open("rb") as fh:
            fh.seek(max(0, fh.seek(0, 2) - 65536))
            tail = fh.read()
    except FileNotFoundError:
        return None
    complete = tail[: tail.rfind(b"\n") + 1].splitlines()
    for raw in reversed(complete):
        try:
            return int(json.loads(raw)["step"])
        except (ValueError, KeyError, TypeError):
            continue  # the first line of the tail window may be cut
    return None


@contextmanager
def watching_metrics(path: Path | None, tracker: StepProgress, every_s: float = MIN_INTERVAL_S) -> Iterator[None]:
    """While inside, read the step of `path`'s last record every `every_s` into `tracker` (no-op for None)."""
    stop = threading.Event()

    def watch(metrics: Path) -> None:
        while not stop.wait(every_s):
            # Before the start line, the file may still hold records of a run this one resumes and truncates.
            if tracker.progress.total is not None and (step := last_step(metrics)) is not None:
                tracker.at_step(step)

    thread = None if path is None else threading.Thread(target=watch, args=(path,), name="train-progress", daemon=True)
    if thread is not None:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        if thread is not None:
            thread.join()


def launch(job: worker.TrainJob, cfg: TrainConfig, spec_path: str, log: logging.Logger | logging.LoggerAdapter) -> None:
    """Run the job on the recipe's torchrun layout (this node's share of it), logging its lines to `log`."""
    d = cfg.distributed
    spec = torchrun.TorchrunSpec(
        module="draftsmith.drafters.training.worker",
        args=["--spec", spec_path],
        nnodes=d.nnodes,
        nproc_per_node=d.nproc_per_node,
        threads_per_rank=cfg.rank_threads(),
        rdzv_endpoint=d.rdzv_endpoint,
        rdzv_id=f"draftsmith-{job.key[:12]}",
        share_files=(spec_path,),
    )
    torchrun.run_torchrun(spec, log=log)


def train_key(
    cfg: TrainConfig,
    drafter_cfg: DrafterConfig,
    target: TargetConfig,
    hidden_cfg: HiddenStatesConfig,
    tokens: StageManifest,
    hidden: StageManifest | None,
    seed: int,
    max_steps: int | None = None,
) -> str:
    """The stage key (`draftsmith.core.stage.stage_key`): the sections, the token shards, the store, seed and
    `max_steps`; the code is this module, the trainer's and the drafter family's."""
    code = [sys.modules[__name__], *CODE, hidden_stream, *families.code_of(drafter_cfg.kind)]
    inputs = {"cfg": cfg, "drafter": drafter_cfg, "target": target, "hidden_cfg": hidden_cfg, "tokens": tokens}
    return stage_key(STAGE, code, **inputs, hidden=hidden, seed=seed, max_steps=max_steps)


def train(
    cfg: TrainConfig,
    drafter_cfg: DrafterConfig,
    target: TargetConfig,
    hidden_cfg: HiddenStatesConfig,
    tokens: StageManifest,
    hidden: StageManifest | None,
    *,
    seed: int,
    out_uri: str,
    max_steps: int | None = None,
) -> StageManifest:
    """Write the drafter's serving checkpoint (`model.safetensors`, `config.json`) and `metrics.jsonl`.

    Offline (`hidden` is the store's manifest) every rank reads its planned micro-batches from the store;
    online (`hidden` is None, `hidden_cfg.mode == "online"`) one rank reads the Mooncake stream while the
    producers capture alongside. `max_steps` stops early (benchmarks) and is part of the cache key.
    """
    if (hidden is None) != (hidden_cfg.mode == "online"):
        raise ValueError(f"train: hidden_states.mode is {hidden_cfg.mode!r} but the store manifest is {hidden!r}")
    key = train_key(cfg, drafter_cfg, target, hidden_cfg, tokens, hidden, seed, max_steps)

    def compute(uri: str) -> StageResult:
        counts_uri = storage.join(uri, "job", "counts.safetensors")
        storage.write_bytes(counts_uri, tensorio.dumps({"counts": loss_token_counts(tokens, target.vocab_size)}))
        job = worker.TrainJob(
            train=cfg.model_dump(mode="json"),
            drafter=drafter_cfg.model_dump(mode="json"),
            target=target.model_dump(mode="json"),
            hidden_cfg=hidden_cfg.model_dump(mode="json"),
            out_uri=uri,
            checkpoint_uri=storage.join(uri, "checkpoints"),
            counts_uri=counts_uri,
            key=key,
            seed=seed,
            hidden_uri=hidden.uri if hidden is not None else None,
            tokens=tokens.model_dump(mode="json"),
            max_steps=max_steps,
            producer_module=hidden_stream.__name__,
        )
        spec_path = storage.local_path(storage.join(uri, "job", "spec.json")) if storage.is_local(uri) else None
        if spec_path is None:  # the ranks read the spec from this node's disk
            spec_path = storage.local_path(storage.join(f"/tmp/draftsmith-train/{key[:16]}", "spec.json"))
        spec_path.parent.mkdir(parents=True, exist_ok=True)
        job.write(str(spec_path))
        with stage_progress(STAGE, uri, None, "train: optimizer steps", unit="step") as progress:
            tracker = StepProgress(_logger(), progress, max_steps)
            # A remote stage folder's metrics.jsonl is a local copy uploaded at checkpoints: the lines tell.
            metrics = storage.local_path(storage.join(uri, "metrics.jsonl")) if storage.is_local(uri) else None
            with watching_metrics(metrics, tracker):
                launch(job, cfg, str(spec_path), tracker)
        result = storage.read_json(storage.join(uri, "result.json"))
        _artifact(result["summary_markdown"], key)
        storage.remove_tree(job.checkpoint_uri)  # the consolidated export is the product; shards were for resume
        files = [FileEntry.model_validate(f) for f in result["files"]]
        return StageResult(files=files, counts=result["counts"], metrics=result["metrics"], info=result["info"])

    return run_stage(STAGE, out_uri, key, compute)


def _artifact(markdown: str, key: str) -> None:
    """The training summary in the Prefect UI; outside a run (tests, benchmarks) there is no UI to show it in."""
    if ui.in_prefect_run():
        create_markdown_artifact(markdown, key=f"train-{key[:12]}", description="Drafter training metrics")


@stage_task("train", STAGE, key=train_key)
def train_task(
    cfg: TrainConfig,
    drafter_cfg: DrafterConfig,
    target: TargetConfig,
    hidden_cfg: HiddenStatesConfig,
    tokens: StageManifest,
    hidden: StageManifest | None,
    seed: int,
    run_dir: str,
) -> StageManifest:
    manifest = train(
        cfg, drafter_cfg, target, hidden_cfg, tokens, hidden, seed=seed, out_uri=storage.join(run_dir, STAGE)
    )
    serve.publish_checkpoint(manifest, target_source=target.source, depth=drafter_cfg.trained_depth)
    return manifest
