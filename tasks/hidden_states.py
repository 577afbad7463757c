"""Stage 4: a target forward over every tokenized sample, capturing the configured taps into the offline store.

Tap k is the residual stream after decoder layer k, counting from 1 (`draftsmith.engines.taps`). The last hidden state
is captured after the final norm unless the recipe says `pre_norm`. The store (`draftsmith.transport.offline_store`)
holds `shard_samples` samples per safetensors shard, commits each shard only once it is whole, and resumes
after the last committed shard; `dataset.json` records taps, capture points, codec, target and tokenizer.
"""

import itertools
import logging
import sys
from collections.abc import Iterable, Iterator

from draftsmith.core import storage
from draftsmith.core.caching import stage_task
from draftsmith.core.config import HiddenStatesConfig, TargetConfig
from draftsmith.core.gpus import gpu_slots
from draftsmith.core.manifest import FileEntry, StageManifest, entry
from draftsmith.core.progress import stage_progress
from draftsmith.core.stage import StageResult, load_manifest, run_stage, stage_key
from draftsmith.engines import hidden_capture
from draftsmith.engines.taps import TAP_CONVENTION
from draftsmith.transport import offline_store
from draftsmith.transport.offline_store import ShardWriter, StoreInfo
from draftsmith.transport.online_source import codec_of
from draftsmith.transport.sample import Dtype, HiddenSample, StoreCodec
from draftsmith.transport.token_shards import token_samples

log = logging.getLogger(__name__)
STAGE = "hidden_states"


def capture_windows(
    engine: hidden_capture.HiddenCapture, samples: Iterable[dict], cfg: HiddenStatesConfig
) -> Iterator[HiddenSample]:
    """Captured samples in input order, the engine called once per window (`hidden_capture.capture_stream`).

    A window holds about two forward budgets of tokens, so length grouping has choice while the captures held in
    the compute dtype stay bounded, and it ends at every shard boundary. A resumed capture starts at a committed
    shard and an online producer of one sees the whole stream, so both batch, and round, exactly as an
    uninterrupted offline capture does.
    """
    return hidden_capture.capture_stream(engine, samples, 2 * cfg.batch_tokens, boundary=cfg.shard_samples)


def store_info(cfg: HiddenStatesConfig, target: TargetConfig, tokens: StageManifest) -> StoreInfo:
    """What `dataset.json` records about the capture."""
    return StoreInfo(
        codec=codec_of(cfg),
        taps=list(cfg.taps),
        hidden_size=target.hidden_size,
        target=target.name,
        tap_point=cfg.tap_point,
        last_hidden=cfg.last_hidden,
        engine=cfg.engine,
        tokenizer_sha256=tokens.info.get("tokenizer_sha256", ""),
        chat_template_sha256=tokens.info.get("chat_template_sha256", ""),
        extra={"tap_convention": TAP_CONVENTION, "target_source": target.source},
    )


def hidden_states_key(cfg: HiddenStatesConfig, target: TargetConfig, tokens: StageManifest) -> str:
    """The stage key (`draftsmith.core.stage.stage_key`): config, target and the token shards."""
    return stage_key(STAGE, [sys.modules[__name__]], cfg=cfg, target=target, tokens=tokens)


def capture_hidden_states(
    cfg: HiddenStatesConfig, target: TargetConfig, tokens: StageManifest, *, out_uri: str
) -> StageManifest:
    """Write the store (`shard-NNNNN.safetensors`, `commits/`, `index.jsonl`, `dataset.json`) under `out_uri`."""
    key = hidden_states_key(cfg, target, tokens)

    def compute(uri: str) -> StageResult:
        writer = ShardWriter(uri, store_info(cfg, target, tokens), cfg.shard_samples)
        if writer.commits:
            log.info("hidden_states: resuming after %d committed samples", writer.committed_samples)
        total = tokens.counts.get("samples", 0)
        with stage_progress(STAGE, uri, total, "hidden_states: samples captured", unit="sample") as progress:
            progress.update(writer.committed_samples)
            rest = itertools.islice(token_samples(tokens), writer.committed_samples, None)
            first = next(rest, None)
            if first is not None:  # start the engine (vLLM takes minutes) only when there is work left
                engine = hidden_capture.make_capture(cfg, target)
                try:
                    for s in capture_windows(engine, itertools.chain([first], rest), cfg):
                        writer.add(s)
                        progress.advance()
                finally:
                    engine.close()
            dataset = writer.finish()
        files = [
            FileEntry(
                name=s["shard"], bytes=s["bytes"], digest=s.get("digest", s["sha256"]), algo=s.get("algo", "sha256")
            )
            for s in dataset["shards"]
        ]
        for name in (offline_store.INDEX, offline_store.DATASET):
            files.append(entry(name, storage.read_bytes(storage.join(uri, name))))
        counts = {
            "samples": dataset["samples"],
            "tokens": dataset["tokens"],
            "loss_tokens": dataset["loss_tokens"],
            "shards": len(dataset["shards"]),
            "bytes": sum(f.bytes for f in files),
        }
        metrics = {"bytes_per_token": counts["bytes"] / max(1, counts["tokens"])}
        info = {"taps": ",".join(map(str, cfg.taps)), "codec": f"{cfg.store_dtype}/{cfg.positions}"}
        return StageResult(files=files, counts=counts, metrics=metrics, info=info | {"engine": cfg.engine})

    return run_stage(STAGE, out_uri, key, compute)


def bytes_per_token(num_taps: int, hidden_size: int, store_dtype: Dtype, supervised_share: float = 1.0) -> float:
    """Stored bytes per token: taps, the last hidden state (on `supervised_share` of rows), int32 id, uint8 mask."""
    codec = StoreCodec(dtype=store_dtype, num_taps=num_taps)
    return codec.tap_bytes_per_token(hidden_size) + supervised_share * codec.last_bytes_per_row(hidden_size) + 5


def finished_tokens(run_dir: str) -> StageManifest:
    """The tokenize stage's manifest under `run_dir`, for a hidden-state run deployed on its own."""
    url = storage.join(run_dir, "tokenize")
    manifest = load_manifest(url)
    if manifest is None or not manifest.artifacts_present():
        raise FileNotFoundError(
            f"{url}: no finished tokenize stage (manifest.json with all its shards); run the pipeline "
            "through tokenize first, or pass `tokens`"
        )
    return manifest


@stage_task("hidden-states", STAGE, key=hidden_states_key)
def hidden_states_task(
    cfg: HiddenStatesConfig, target: TargetConfig, tokens: StageManifest, run_dir: str
) -> StageManifest:
    with gpu_slots(cfg.resources):
        return capture_hidden_states(cfg, target, tokens, out_uri=storage.join(run_dir, STAGE))
