"""`draftsmith plan`: what a recipe would run, where, and how much hidden-state data it would write."""

from draftsmith import storage
from draftsmith.config import PipelineConfig, Resources
from tasks.hidden_states import bytes_per_token

# A synthetic prompt renders to about this many tokens with the chat template; JSONL corpora vary.
PROMPT_TOKENS_ESTIMATE = 64


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _where(r: Resources) -> str:
    return f"pool={r.work_pool} nodes={r.nodes} gpus/node={r.gpus} cpus={r.cpus} mem={r.memory_gb}GiB"


def estimate_tokens(cfg: PipelineConfig) -> int:
    per_sample = min(cfg.tokenize.max_length, PROMPT_TOKENS_ESTIMATE + cfg.regenerate.max_new_tokens)
    return (cfg.select.num_prompts - cfg.select.num_eval) * per_sample


def render_plan(cfg: PipelineConfig, run_dir: str) -> str:
    """A human-readable dry run: stages in order, their outputs, resources and the data estimate."""
    tokens = estimate_tokens(cfg)
    bpt = bytes_per_token(len(cfg.hidden_states.taps), cfg.target.hidden_size, cfg.hidden_states.store_dtype)
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
            f"taps {cfg.hidden_states.taps} + {cfg.hidden_states.last_hidden} last hidden, "
            f"{cfg.hidden_states.store_dtype}: ~{tokens:,} tokens x {bpt:,} B = ~{_human(tokens * bpt)}",
        ),
        (
            "train",
            cfg.train.resources,
            f"{cfg.drafter.kind} (TTT depth {cfg.drafter.ttt_depth}, draft vocab {cfg.drafter.draft_vocab_size}), "
            f"{cfg.train.epochs} epochs",
        ),
        (
            "evaluate",
            cfg.evaluate.resources,
            f"{cfg.evaluate.verification} speculative decoding, {cfg.evaluate.num_draft_tokens} draft tokens, "
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
    lines.append(
        f"hidden-state estimate: {_human(tokens * bpt)} ({bpt:,} bytes/token = "
        f"({len(cfg.hidden_states.taps)} taps + last) x {cfg.target.hidden_size} x dtype + id + mask)"
    )
    return "\n".join(lines)
