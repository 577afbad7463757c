"""`draftsmith plan`: what a recipe would run, where, and how much hidden-state data it would write."""

import logging
from dataclasses import dataclass

from draftsmith.core import storage
from draftsmith.core.config import PipelineConfig, Resources
from draftsmith.core.manifest import StageManifest
from draftsmith.core.stage import load_manifest
from draftsmith.tasks.hidden_states import bytes_per_token
from draftsmith.transport.sample import StoreCodec

log = logging.getLogger(__name__)
# A synthetic prompt renders to about this many tokens with the chat template; JSONL corpora vary.
PROMPT_TOKENS_ESTIMATE = 64


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _num(x: float) -> str:
    return f"{int(x):,}" if float(x).is_integer() else f"{x:,.1f}"


def _where(r: Resources) -> str:
    return f"pool={r.work_pool} nodes={r.nodes} gpus/node={r.gpus} cpus={r.cpus} mem={r.memory_gb}GiB"


def estimate_tokens(cfg: PipelineConfig) -> int:
    per_sample = min(cfg.tokenize.max_length, PROMPT_TOKENS_ESTIMATE + cfg.regenerate.max_new_tokens)
    return (cfg.select.num_prompts - cfg.select.num_eval) * per_sample


@dataclass(frozen=True)
class StoreSize:
    """The hidden-state store's size: exact once the tokenize stage has run, else estimated."""

    tokens: int
    supervised_rows: int
    samples: int
    bytes: int
    exact: bool

    def bytes_per_token(self) -> float:
        return self.bytes / max(1, self.tokens)


def _finished_tokenize(run_dir: str) -> StageManifest | None:
    """The run's finished tokenize manifest, or None (also when the run folder cannot be read: a dry run
    on a laptop without the cluster's S3 credentials still prints the estimate)."""
    try:
        manifest = load_manifest(storage.join(run_dir, "tokenize"))
        return manifest if manifest is not None and manifest.artifacts_present() else None
    except Exception as e:  # any storage failure means "not known here"
        log.info("plan: cannot read %s/tokenize (%s); estimating", run_dir, type(e).__name__)
        return None


def store_size(cfg: PipelineConfig, run_dir: str) -> StoreSize:
    """Bytes of the shards' tensor data: taps, last hidden (every row, or the supervised ones), int32 ids,
    uint8 mask, two int64 offsets per sample plus two per shard. Headers (under 1 KiB a shard) aside.

    With a finished tokenize stage under `run_dir` the token and loss-token counts are the real ones, so the
    figure is exact; otherwise they come from the recipe (`estimate_tokens`).
    """
    hs = cfg.hidden_states
    codec = StoreCodec(dtype=hs.store_dtype, positions=hs.positions, num_taps=len(hs.taps))
    manifest = _finished_tokenize(run_dir)
    exact = manifest is not None
    if manifest is not None:
        tokens, samples, loss = manifest.counts["tokens"], manifest.counts["samples"], manifest.counts["loss_tokens"]
    else:
        samples = cfg.select.num_prompts - cfg.select.num_eval
        tokens = estimate_tokens(cfg)
        loss = tokens * cfg.regenerate.max_new_tokens // max(1, PROMPT_TOKENS_ESTIMATE + cfg.regenerate.max_new_tokens)
    # A supervised row is one whose next token is a loss token: every loss token but one at position 0 (never).
    rows = loss if hs.positions == "supervised" else tokens
    H = cfg.target.hidden_size
    shards = -(-samples // hs.shard_samples)  # each shard's two offset tensors have n + 1 entries
    size = (
        tokens * (codec.tap_bytes_per_token(H) + 4 + 1) + rows * codec.last_bytes_per_row(H) + (samples + shards) * 16
    )
    return StoreSize(tokens=tokens, supervised_rows=rows, samples=samples, bytes=int(size), exact=exact)


def render_plan(cfg: PipelineConfig, run_dir: str) -> str:
    """A human-readable dry run: stages in order, their outputs, resources and the data estimate."""
    size = store_size(cfg, run_dir)
    tokens = size.tokens
    hs = cfg.hidden_states
    bpt = bytes_per_token(len(hs.taps), cfg.target.hidden_size, hs.store_dtype)
    train_prompts = cfg.select.num_prompts - cfg.select.num_eval
    stages = [
        (
            "select_prompts",
            cfg.select.resources,
            f"{train_prompts} train + {cfg.select.num_eval} held-out prompts from "
            + ", ".join(f"{s.kind}:{s.path}" if s.path else s.kind for s in cfg.select.resolved_sources()),
        ),
        (
            "regenerate",
            cfg.regenerate.resources,
            f"conversation shards by {cfg.regenerate.engine} ({cfg.target.name}), "
            f"<= {cfg.regenerate.max_new_tokens} tokens per turn, temperature {cfg.regenerate.temperature}",
        ),
        (
            "tokenize",
            cfg.tokenize.resources,
            f"token shards, max_length {cfg.tokenize.max_length}, {cfg.tokenize.num_workers} workers",
        ),
        (
            "hidden_states",
            cfg.hidden_states.resources,
            f"{hs.engine} engine, taps {hs.taps} ({hs.tap_point}) + {hs.last_hidden} last hidden, "
            f"{hs.store_dtype}/{hs.positions}: {'' if size.exact else '~'}{tokens:,} tokens = "
            f"{'' if size.exact else '~'}{_human(size.bytes)}",
        ),
        (
            "train",
            cfg.train.resources,
            f"{_drafter(cfg.drafter)}, {cfg.train.epochs} epochs\n   {_trainer(cfg.train)}",
        ),
        (
            "evaluate",
            cfg.evaluate.resources,
            f"{cfg.evaluate.verification} speculative decoding, "
            f"{cfg.drafter.drafts_per_round(cfg.evaluate.num_draft_tokens)} draft tokens per round, "
            f"<= {cfg.evaluate.max_new_tokens} new tokens per prompt",
        ),
    ]
    lines = [
        f"recipe {cfg.name}: target {cfg.target.name} ({cfg.target.num_layers} layers, "
        f"H={cfg.target.hidden_size}, V={cfg.target.vocab_size}), run dir {run_dir}"
    ]
    for i, (name, res, what) in enumerate(stages, 1):
        lines.append(f"{i}. {name:<15} -> {storage.join(run_dir, name)}")
        lines.append(f"   {what}")
        lines.append(f"   {_where(res)}")
    kind = "exact (from the finished tokenize stage)" if size.exact else "estimated from the recipe"
    lines.append(
        f"hidden-state store: {size.bytes:,} bytes = {_human(size.bytes)}, {kind}: {tokens:,} tokens x "
        f"{_num(bpt)} bytes/token (({len(hs.taps)} taps + last) x {cfg.target.hidden_size} x "
        f"{hs.store_dtype} + 4-byte id + 1-byte mask"
        + (f"; last hidden on {size.supervised_rows:,} supervised rows only" if hs.positions == "supervised" else "")
        + ")"
    )
    return "\n".join(lines)


def _drafter(d) -> str:
    """One line on the drafter: family, layers and attention, what it trains on."""
    return d.describe()


def _trainer(t) -> str:
    """One line on the FSDP2 job: torchrun layout, precision, batch per step, schedule, checkpoints."""
    d, mp = t.distributed, t.mixed_precision
    backend = d.backend if d.backend != "auto" else ("nccl" if t.resources.gpus else "gloo")
    ckpt = (
        f"DCP every {t.checkpoint.every_steps} steps, keep {t.checkpoint.keep}"
        if t.checkpoint.every_steps
        else "no checkpoints"
    )
    return (
        f"torchrun {d.nnodes} node(s) x {d.nproc_per_node} rank(s) = {t.world_size} ranks ({backend}), FSDP2 "
        f"{mp.param_dtype} params/{mp.reduce_dtype} reduce, {t.world_size} x {t.grad_accum} micro-batches of "
        f"<= {t.batch_tokens:,} padded tokens per step, {t.schedule} LR {t.lr:g} after {t.warmup_steps} "
        f"warm-up steps, {ckpt}"
    )
