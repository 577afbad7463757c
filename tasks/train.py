"""Stage 5: train the drafter on the captured hidden states with the FSDP2 trainer, launched by torchrun.

The task writes a job spec into the stage folder, runs `torchrun ... -m drafters.training.worker` with the
recipe's nodes, ranks and rendezvous (`engines.torchrun` streams every rank's log into this task's log and
fails with the failing rank's traceback), and turns the `result.json` rank 0 wrote into the manifest. A
retried or re-run task with the same inputs resumes from the newest checkpoint in `<stage>/checkpoints`.
"""

import logging
import sys

import torch
from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.context import FlowRunContext, TaskRunContext
from prefect.exceptions import MissingContextError

from drafters import data, families
from drafters.training import checkpoint, fsdp, loop, plan, run, schedule, target_parts, worker
from draftsmith import storage, tensorio
from draftsmith.caching import stage_task
from draftsmith.config import DrafterConfig, HiddenStatesConfig, TargetConfig, TrainConfig
from draftsmith.manifest import FileEntry, StageManifest
from draftsmith.stage import StageResult, run_stage, stage_key
from engines import torchrun
from tasks import hidden_stream
from tasks.hidden_states import token_samples
from transport import offline_reader, sample

STAGE = "train"
CODE = [data, families, checkpoint, fsdp, loop, plan, run, schedule, target_parts, worker, offline_reader, sample]


def loss_token_counts(tokens: StageManifest, vocab_size: int) -> torch.Tensor:
    """How often each target id appears as a loss token `[V]`, over the tokenized corpus."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in token_samples(tokens):
        counts += torch.bincount(s["input_ids"][s["loss_mask"]], minlength=vocab_size)
    return counts


def _logger() -> logging.Logger | logging.LoggerAdapter:
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("draftsmith.train")


def launch(job: worker.TrainJob, cfg: TrainConfig, spec_path: str) -> None:
    """Run the job on the recipe's torchrun layout (this node's share of it)."""
    d = cfg.distributed
    spec = torchrun.TorchrunSpec(
        module="drafters.training.worker",
        args=["--spec", spec_path],
        nnodes=d.nnodes,
        nproc_per_node=d.nproc_per_node,
        threads_per_rank=cfg.rank_threads(),
        rdzv_endpoint=d.rdzv_endpoint,
        rdzv_id=f"draftsmith-{job.key[:12]}",
        share_files=(spec_path,),
    )
    torchrun.run_torchrun(spec, log=_logger())


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
    family = families.family(drafter_cfg.kind)
    code = [sys.modules[__name__], *CODE, hidden_stream, family, *family.code_modules()]
    inputs = {"cfg": cfg, "drafter": drafter_cfg, "target": target, "hidden_cfg": hidden_cfg, "tokens": tokens}
    key = stage_key(STAGE, code, **inputs, hidden=hidden, seed=seed, max_steps=max_steps)

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
        )
        spec_path = storage.local_path(storage.join(uri, "job", "spec.json")) if storage.is_local(uri) else None
        if spec_path is None:  # the ranks read the spec from this node's disk
            spec_path = storage.local_path(storage.join(f"/tmp/draftsmith-train/{key[:16]}", "spec.json"))
        spec_path.parent.mkdir(parents=True, exist_ok=True)
        job.write(str(spec_path))
        launch(job, cfg, str(spec_path))
        result = storage.read_json(storage.join(uri, "result.json"))
        _artifact(result["summary_markdown"], key)
        storage.remove_tree(job.checkpoint_uri)  # the consolidated export is the product; shards were for resume
        files = [FileEntry.model_validate(f) for f in result["files"]]
        return StageResult(files=files, counts=result["counts"], metrics=result["metrics"], info=result["info"])

    return run_stage(STAGE, out_uri, key, compute)


def _artifact(markdown: str, key: str) -> None:
    """The training summary in the Prefect UI; outside a run (tests, benchmarks) there is no UI to show it in."""
    if FlowRunContext.get() is not None or TaskRunContext.get() is not None:
        create_markdown_artifact(markdown, key=f"train-{key[:12]}", description="Drafter training metrics")


@stage_task("train", STAGE)
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
    return train(cfg, drafter_cfg, target, hidden_cfg, tokens, hidden, seed=seed, out_uri=storage.join(run_dir, STAGE))
