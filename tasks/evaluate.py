"""Stage 6: real speculative decoding of the held-out prompts, with and without the drafter.

Both decoders run in the same process on the same prompts, one after the other per prompt, so the
tokens/s figures are comparable. Greedy verification is lossless: the speculative output must equal
the baseline token for token, and any difference is counted and reported.
"""

import json
import sys
from collections import defaultdict

import torch
from transformers import PreTrainedTokenizerBase

from drafters import families, verify
from drafters.eagle3 import decode
from draftsmith import storage
from draftsmith.caching import stage_task
from draftsmith.config import DrafterConfig, EvaluateConfig, TargetConfig
from draftsmith.manifest import StageManifest, file_entry
from draftsmith.stage import StageResult, run_stage, stage_key
from engines import hf
from tasks.prompt_pool import PromptRecord
from tasks.select_prompts import read_prompts

STAGE = "evaluate"


def prompt_ids(tok: PreTrainedTokenizerBase, record: PromptRecord) -> torch.Tensor:
    """The first user turn (with its system prompt), rendered for generation, `[S]`."""
    msgs = [{"role": "system", "content": record.system}] if record.system else []
    msgs.append({"role": "user", "content": record.turns[0]})
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    return torch.tensor(tok(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def summarise(rows: list[dict], drafter: str) -> dict:
    """results.json: acc_len overall and per category, tokens/s with and without speculation."""
    by_cat: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_cat[r["category"]].append(r)

    def acc_len(group: list[dict]) -> float:
        rounds = sum(r["rounds"] for r in group)
        return round(1.0 + sum(r["accepted"] for r in group) / max(1, rounds), 4)

    def tps(group: list[dict], key: str) -> float:
        return round(sum(r["tokens"] for r in group) / sum(r[f"{key}_seconds"] for r in group), 3)

    results = {
        "drafter": drafter,
        "acc_len": {"overall": acc_len(rows)} | {c: acc_len(g) for c, g in sorted(by_cat.items())},
        "tokens_per_s": {"baseline": tps(rows, "baseline"), "speculative": tps(rows, "speculative")},
    }
    results["speedup"] = round(results["tokens_per_s"]["speculative"] / results["tokens_per_s"]["baseline"], 3)
    results["prompts"] = len(rows)
    results["mismatched_outputs"] = sum(not r["identical"] for r in rows)
    return results


def format_table(results: dict) -> str:
    """The acceptance table that `draftsmith run` prints."""
    lines = [f"{'category':<14}{'acc_len':>9}", "-" * 23]
    for cat, value in results["acc_len"].items():
        if cat != "overall":
            lines.append(f"{cat:<14}{value:>9.3f}")
    lines += ["-" * 23, f"{'overall':<14}{results['acc_len']['overall']:>9.3f}"]
    t = results["tokens_per_s"]
    lines.append(
        f"tokens/s: baseline {t['baseline']:.2f}, speculative {t['speculative']:.2f} "
        f"(x{results['speedup']:.2f}); {results['prompts']} prompts, "
        f"{results['mismatched_outputs']} outputs differ from greedy"
    )
    return "\n".join(lines)


def evaluate(
    cfg: EvaluateConfig,
    drafter_cfg: DrafterConfig,
    target: TargetConfig,
    prompts: StageManifest,
    checkpoint: StageManifest,
    *,
    out_uri: str,
) -> StageManifest:
    """Write `results.json` and per-prompt `prompts.jsonl` under `out_uri`."""
    family = families.family(drafter_cfg.kind)
    key = stage_key(
        STAGE,
        [sys.modules[__name__], decode, verify, family, *family.code_modules()],
        cfg=cfg,
        drafter=drafter_cfg,
        target=target,
        prompts=prompts,
        checkpoint=checkpoint,
    )

    def compute(uri: str) -> StageResult:
        model, tok = hf.load_target(target)
        drafter, taps = family.load(checkpoint.uri, model)
        g = drafter_cfg.drafts_per_round(cfg.num_draft_tokens)
        eos = set(hf.end_of_turn_ids(tok, model))
        records = read_prompts(prompts, "eval")[: cfg.max_prompts]
        decode.greedy_generate(model, prompt_ids(tok, records[0]), max_new=4, eos=eos)  # warm-up
        rows = []
        for rec in records:
            ids = prompt_ids(tok, rec)
            base = decode.greedy_generate(model, ids, max_new=cfg.max_new_tokens, eos=eos)
            spec = family.generate(model, drafter, taps, ids, g=g, max_new=cfg.max_new_tokens, eos=eos)
            rows.append(
                {
                    "id": rec.id,
                    "category": rec.category,
                    "tokens": len(base.tokens),
                    "rounds": spec.rounds,
                    "accepted": spec.accepted,
                    "identical": spec.tokens == base.tokens,
                    "baseline_seconds": base.seconds,
                    "speculative_seconds": spec.seconds,
                }
            )
        results = summarise(rows, drafter_cfg.kind) | {"draft_tokens_per_round": g}
        files = [
            file_entry(uri, "results.json", (json.dumps(results, indent=2) + "\n").encode()),
            file_entry(uri, "prompts.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode()),
        ]
        metrics = {"acc_len": results["acc_len"]["overall"], "speedup": results["speedup"]}
        return StageResult(files=files, counts={"prompts": len(rows)}, metrics=metrics)

    return run_stage(STAGE, out_uri, key, compute)


def read_results(manifest: StageManifest) -> dict:
    return storage.read_json(manifest.path("results.json"))


@stage_task("evaluate", STAGE)
def evaluate_task(
    cfg: EvaluateConfig,
    drafter_cfg: DrafterConfig,
    target: TargetConfig,
    prompts: StageManifest,
    checkpoint: StageManifest,
    run_dir: str,
) -> StageManifest:
    return evaluate(cfg, drafter_cfg, target, prompts, checkpoint, out_uri=storage.join(run_dir, STAGE))
