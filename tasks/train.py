"""Stage 5: train the drafter on the captured hidden states and save a serving-format checkpoint."""

import json
import sys

import torch
from transformers import PretrainedConfig, PreTrainedModel

from drafters import data, trainer, vocab
from drafters.eagle3 import export, loss, model
from draftsmith import storage
from draftsmith.caching import stage_task
from draftsmith.config import DrafterConfig, HiddenStatesConfig, TargetConfig, TrainConfig
from draftsmith.manifest import StageManifest, file_entry
from draftsmith.stage import StageResult, run_stage, stage_key
from engines import hf

STAGE = "train"


def rope_theta(config: PretrainedConfig) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta") or getattr(config, "rope_theta", 10000.0))


def build_drafter(
    cfg: DrafterConfig, target: TargetConfig, num_taps: int, target_model: PreTrainedModel, counts_V: torch.Tensor
) -> model.Eagle3Drafter:
    """A fresh drafter with the target's frozen embedding and a vocabulary pruned by `counts_V`."""
    spec = model.Eagle3Spec(
        hidden_size=target.hidden_size,
        target_hidden_size=target.hidden_size,
        num_taps=num_taps,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        intermediate_size=cfg.intermediate_size,
        vocab_size=target.vocab_size,
        draft_vocab_size=cfg.draft_vocab_size,
        rope_theta=rope_theta(target_model.config),
        rms_norm_eps=float(getattr(target_model.config, "rms_norm_eps", 1e-5)),
        fc_norm=cfg.fc_norm,
        norm_output=cfg.norm_output,
    )
    drafter = model.Eagle3Drafter(spec)
    d2t, t2d = vocab.build_draft_vocab(counts_V, cfg.draft_vocab_size)
    drafter.d2t.copy_(d2t)
    drafter.t2d.copy_(t2d)
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(target_model.get_input_embeddings().weight.float())
        if cfg.init_lm_head_from_target:
            # The draft head predicts the same next-token distribution as the target's; starting there
            # instead of at random saves most of the early steps on a small corpus.
            head = target_model.get_output_embeddings().weight.float()
            drafter.lm_head.weight.copy_(head[vocab.draft_ids(d2t)])
    return drafter


def loss_token_counts(samples: list[data.TrainSample], vocab_size: int) -> torch.Tensor:
    """How often each target id appears as a loss token `[V]`."""
    ids = torch.cat([s.input_ids[s.loss_mask] for s in samples])
    return torch.bincount(ids, minlength=vocab_size)


def train(
    cfg: TrainConfig,
    drafter_cfg: DrafterConfig,
    target: TargetConfig,
    hidden_cfg: HiddenStatesConfig,
    hidden: StageManifest,
    *,
    seed: int,
    out_uri: str,
) -> StageManifest:
    """Write `model.safetensors`, `config.json` (vLLM eagle3 format) and `metrics.jsonl`."""
    code = [sys.modules[__name__], data, trainer, vocab, export, loss, model]
    key = stage_key(
        STAGE,
        code,
        cfg=cfg,
        drafter=drafter_cfg,
        target=target,
        hidden_cfg=hidden_cfg,
        hidden=hidden,
        seed=seed,
    )

    def compute(uri: str) -> StageResult:
        samples = data.load_hidden_shards(hidden)
        target_model, _ = hf.load_target(target)
        torch.manual_seed(seed)
        drafter = build_drafter(
            drafter_cfg,
            target,
            len(hidden_cfg.taps),
            target_model,
            loss_token_counts(samples, target.vocab_size),
        )
        head = target_model.get_output_embeddings().weight.detach().float()
        report = trainer.train_eagle3(
            drafter, samples, head, cfg, depth=drafter_cfg.ttt_depth, decay=drafter_cfg.depth_decay, seed=seed
        )
        meta = {
            "target": target.name,
            "hidden_states_key": hidden.key,
            "tap_convention": "residual after layer k, from 1",
        }
        blobs = export.checkpoint_blobs(drafter, hidden_cfg.taps, meta)
        blobs["metrics.jsonl"] = "".join(json.dumps(h) + "\n" for h in report.history).encode()
        files = [file_entry(uri, name, blob) for name, blob in blobs.items()]
        metrics = {k: round(v, 5) for k, v in report.final().items()} | {"tokens_per_s": report.tokens / report.seconds}
        counts = {"steps": report.steps, "samples": len(samples), "padded_tokens": report.tokens}
        return StageResult(files=files, counts=counts, metrics=metrics, info={"drafter": drafter_cfg.kind})

    return run_stage(STAGE, out_uri, key, compute)


@stage_task("train", STAGE)
def train_task(
    cfg: TrainConfig,
    drafter_cfg: DrafterConfig,
    target: TargetConfig,
    hidden_cfg: HiddenStatesConfig,
    hidden: StageManifest,
    seed: int,
    run_dir: str,
) -> StageManifest:
    return train(cfg, drafter_cfg, target, hidden_cfg, hidden, seed=seed, out_uri=storage.join(run_dir, STAGE))
