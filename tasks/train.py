"""Stage 5: train the drafter on the captured hidden states and save a serving-format checkpoint."""

import functools
import json
import sys
from collections.abc import Iterator

import torch

from drafters import data, families, trainer
from draftsmith import storage
from draftsmith.caching import stage_task
from draftsmith.config import DrafterConfig, HiddenStatesConfig, TargetConfig, TrainConfig
from draftsmith.manifest import StageManifest, file_entry
from draftsmith.stage import StageResult, run_stage, stage_key
from engines import hf
from tasks import hidden_stream
from tasks.hidden_states import token_samples
from tasks.hidden_stream import OnlineSource
from transport import offline_reader, sample
from transport.offline_reader import OfflineDataset, PrefetchLoader

STAGE = "train"


def loss_token_counts(tokens: StageManifest, vocab_size: int) -> torch.Tensor:
    """How often each target id appears as a loss token `[V]`, over the tokenized corpus."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in token_samples(tokens):
        counts += torch.bincount(s["input_ids"][s["loss_mask"]], minlength=vocab_size)
    return counts


def offline_batches(
    dataset: OfflineDataset, cfg: TrainConfig, seed: int
) -> tuple[Iterator[tuple[int, list[data.TrainSample]]], int]:
    """`(epoch, samples)` per step from the store through the prefetching loader, and the step count."""
    plans = [data.length_grouped_batches(dataset.lengths, cfg.batch_tokens, seed=seed + e) for e in range(cfg.epochs)]

    def gen() -> Iterator[tuple[int, list[data.TrainSample]]]:
        for epoch, plan in enumerate(plans):
            for samples in PrefetchLoader(dataset, plan, workers=cfg.loader_workers, prefetch=cfg.prefetch):
                yield epoch, samples

    return gen(), sum(len(p) for p in plans)


def online_batches(
    source: OnlineSource, tokens: StageManifest, cfg: TrainConfig, hidden_cfg: HiddenStatesConfig, seed: int
) -> tuple[Iterator[tuple[int, list[data.TrainSample]]], int]:
    """`(epoch, samples)` per step as the stream delivers, and the step count (exact for one producer)."""
    lengths = [len(s["input_ids"]) for s in token_samples(tokens)]
    window = hidden_cfg.online.window_samples
    per_epoch = data.count_stream_batches(lengths, cfg.batch_tokens, window)
    per_epoch_samples = len(lengths)

    def gen() -> Iterator[tuple[int, list[data.TrainSample]]]:
        seen = 0
        for batch in data.stream_batches(source.samples(), cfg.batch_tokens, window, seed=seed):
            yield seen // max(1, per_epoch_samples), batch
            seen += len(batch)

    return gen(), per_epoch * cfg.epochs


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
) -> StageManifest:
    """Write the drafter's serving checkpoint (`model.safetensors`, `config.json`) and `metrics.jsonl`.

    Offline (`hidden` is the store's manifest) batches come from the store through the prefetching loader;
    online (`hidden` is None, `hidden_cfg.mode == "online"`) from the Mooncake stream, with the producers
    capturing alongside.
    """
    if (hidden is None) != (hidden_cfg.mode == "online"):
        raise ValueError(f"train: hidden_states.mode is {hidden_cfg.mode!r} but the store manifest is {hidden!r}")
    family = families.family(drafter_cfg.kind)
    code = [sys.modules[__name__], data, trainer, families, family, offline_reader, sample, hidden_stream]
    code += family.code_modules()
    inputs = {"cfg": cfg, "drafter": drafter_cfg, "target": target, "hidden_cfg": hidden_cfg, "tokens": tokens}
    key = stage_key(STAGE, code, **inputs, hidden=hidden, seed=seed)

    def compute(uri: str) -> StageResult:
        target_model, _ = hf.load_target(target)
        torch.manual_seed(seed)
        counts_V = loss_token_counts(tokens, target.vocab_size)
        inputs = families.BuildInputs(target, target_model, len(hidden_cfg.taps), counts_V)
        drafter = family.build(drafter_cfg, inputs)
        head = target_model.get_output_embeddings().weight.detach().float()
        objective = family.objective(drafter_cfg, drafter, head, seed)
        fit = functools.partial(trainer.train_drafter, drafter, objective=objective, cfg=cfg, seed=seed)
        if hidden is not None:
            dataset = data.hidden_dataset(hidden)
            report = fit(*offline_batches(dataset, cfg, seed))
            num_samples, source = len(dataset), "offline"
        else:
            with OnlineSource(hidden_cfg, target, tokens, epochs=cfg.epochs, run_id=key[:12]) as online:
                report = fit(*online_batches(online, tokens, cfg, hidden_cfg, seed))
                num_samples, source = online.stream.consumed, "online"
        max_positions = int(getattr(target_model.config, "max_position_embeddings", 0) or 0) or None
        result = (report, target, hidden_cfg, key, num_samples, drafter_cfg.kind, source, max_positions)
        return _result(uri, family, drafter, *result)

    return run_stage(STAGE, out_uri, key, compute)


def _result(
    uri: str,
    family,
    drafter: torch.nn.Module,
    report: trainer.TrainReport,
    target: TargetConfig,
    hidden_cfg: HiddenStatesConfig,
    key: str,
    num_samples: int,
    kind: str,
    source: str,
    max_positions: int | None,
) -> StageResult:
    meta = {
        "target": target.name,
        "train_key": key,
        "tap_convention": "residual after layer k, from 1",
        "num_target_layers": target.num_layers,
        "max_position_embeddings": max_positions,
    }
    blobs = family.checkpoint_blobs(drafter, hidden_cfg.taps, meta)
    blobs["metrics.jsonl"] = "".join(json.dumps(h) + "\n" for h in report.history).encode()
    files = [file_entry(uri, name, blob) for name, blob in blobs.items()]
    metrics = {k: round(v, 5) for k, v in report.final().items()} | {"tokens_per_s": report.tokens / report.seconds}
    counts = {"steps": report.steps, "samples": num_samples, "padded_tokens": report.tokens}
    return StageResult(files=files, counts=counts, metrics=metrics, info={"drafter": kind, "hidden_states": source})


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
