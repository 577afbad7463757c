"""Stage 4: a target forward over every tokenized sample, capturing the configured taps.

Tap k is the residual stream after decoder layer k, counting from 1 (HF `hidden_states[k]`, vLLM aux
id k). The last hidden state is captured after the final norm unless the recipe says `pre_norm`.
Each token shard becomes one `hidden-NNNNN.safetensors` holding many samples back to back:

- `input_ids` int32 `[T]`, `loss_mask` uint8 `[T]`, `offsets` int64 `[n+1]` (sample i is `offsets[i]:offsets[i+1]`)
- `hidden_states` `[T, N*H]` (taps concatenated in tap order), `last_hidden` `[T, H]`, both in `store_dtype`
"""

import json
import logging
import sys

import torch
from transformers import PreTrainedModel

from draftsmith import storage, tensorio
from draftsmith.batching import group_by_length
from draftsmith.caching import stage_task
from draftsmith.config import HiddenStatesConfig, TargetConfig
from draftsmith.manifest import FileEntry, StageManifest, file_entry
from draftsmith.stage import StageResult, run_stage, stage_key
from engines import hf
from tasks.tokenization import read_token_shard

log = logging.getLogger(__name__)
STAGE = "hidden_states"
FORMAT_VERSION = 1


def capture_samples(
    model: PreTrainedModel, samples: list[dict], cfg: HiddenStatesConfig, pad_id: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sample: taps `[S, N*H]` and last hidden `[S, H]`, in `store_dtype`, in input order.

    Samples are batched (right-padded) so that `batch * longest <= cfg.batch_tokens`; a sample longer than the
    budget runs alone as a chunked prefill of `batch_tokens` positions per forward (`hf.forward_with_taps_chunked`),
    so activation memory stays bounded by the budget whatever the length.
    """
    dtype = getattr(torch, cfg.store_dtype)
    out: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(samples)
    for batch in group_by_length([len(s["input_ids"]) for s in samples], cfg.batch_tokens):
        width = len(samples[batch[0]]["input_ids"])
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, i in enumerate(batch):
            n = len(samples[i]["input_ids"])
            ids[row, :n] = samples[i]["input_ids"]
            mask[row, :n] = 1
        taps_BSNH, last_BSH = hf.forward_with_taps(
            model, ids, mask, cfg.taps, last_hidden=cfg.last_hidden, chunk_tokens=cfg.batch_tokens
        )
        for row, i in enumerate(batch):
            n = len(samples[i]["input_ids"])
            out[i] = (taps_BSNH[row, :n].flatten(1).to(dtype), last_BSH[row, :n].to(dtype))
    return [o for o in out if o is not None]


def _shard_blob(samples: list[dict], captured: list[tuple[torch.Tensor, torch.Tensor]], meta: dict[str, str]) -> bytes:
    lengths = torch.tensor([len(s["input_ids"]) for s in samples], dtype=torch.int64)
    tensors = {
        "input_ids": torch.cat([s["input_ids"] for s in samples]).to(torch.int32),
        "loss_mask": torch.cat([s["loss_mask"] for s in samples]).to(torch.uint8),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
        "hidden_states": torch.cat([h for h, _ in captured]),
        "last_hidden": torch.cat([lh for _, lh in captured]),
    }
    shard_meta = meta | {
        "ids": json.dumps([s["id"] for s in samples]),
        "categories": json.dumps([s["category"] for s in samples]),
    }
    return tensorio.dumps(tensors, shard_meta)


def capture_hidden_states(
    cfg: HiddenStatesConfig, target: TargetConfig, tokens: StageManifest, *, out_uri: str
) -> StageManifest:
    """Write `hidden-NNNNN.safetensors` shards, `index.jsonl` and `dataset.json` under `out_uri`."""
    key = stage_key(STAGE, [sys.modules[__name__], hf], cfg=cfg, target=target, tokens=tokens)

    def compute(uri: str) -> StageResult:
        model, tok = hf.load_target(target)
        meta = {"taps": json.dumps(cfg.taps), "last_hidden": cfg.last_hidden, "target": target.name}
        files: list[FileEntry] = []
        index: list[dict] = []
        for shard, name in enumerate(tokens.names("tokens-")):
            out_name = f"hidden-{shard:05d}.safetensors"
            samples = read_token_shard(storage.read_bytes(tokens.path(name)))
            if not storage.exists(storage.join(uri, out_name)):
                captured = capture_samples(model, samples, cfg, tok.pad_token_id)
                storage.write_bytes(storage.join(uri, out_name), _shard_blob(samples, captured, meta))
            data = storage.read_bytes(storage.join(uri, out_name))
            files.append(FileEntry(name=out_name, bytes=len(data), sha256=storage.sha256(data)))
            start = 0
            for s in samples:
                n = len(s["input_ids"])
                index.append(
                    {
                        "id": s["id"],
                        "shard": out_name,
                        "start": start,
                        "length": n,
                        "loss_tokens": int(s["loss_mask"].sum()),
                    }
                )
                start += n
            log.info("hidden_states: %s (%d samples)", out_name, len(samples))
        dataset = {
            "version": FORMAT_VERSION,
            "taps": cfg.taps,
            "tap_convention": "residual stream after decoder layer k, counting from 1 (HF hidden_states[k])",
            "last_hidden": cfg.last_hidden,
            "dtype": cfg.store_dtype,
            "hidden_size": target.hidden_size,
            "target": target.name,
        }
        files.append(file_entry(uri, "index.jsonl", "".join(json.dumps(r) + "\n" for r in index).encode()))
        files.append(file_entry(uri, "dataset.json", json.dumps(dataset, indent=2).encode()))
        num_tokens = sum(r["length"] for r in index)
        counts = {"samples": len(index), "tokens": num_tokens, "bytes": sum(f.bytes for f in files)}
        return StageResult(files=files, counts=counts, info={"taps": json.dumps(cfg.taps)})

    return run_stage(STAGE, out_uri, key, compute)


def bytes_per_token(num_taps: int, hidden_size: int, store_dtype: str) -> int:
    """Stored bytes per token: taps and last hidden state, plus int32 id and uint8 mask."""
    width = 2 if store_dtype == "bfloat16" else 4
    return (num_taps + 1) * hidden_size * width + 4 + 1


@stage_task("hidden-states", STAGE)
def hidden_states_task(
    cfg: HiddenStatesConfig, target: TargetConfig, tokens: StageManifest, run_dir: str
) -> StageManifest:
    return capture_hidden_states(cfg, target, tokens, out_uri=storage.join(run_dir, STAGE))
