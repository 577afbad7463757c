"""Stage 6: real speculative decoding of benchmark prompts, with and without the drafter.

The benchmarks are the built-in suites (one per prompt category; the embedded default), the recipe's
held-out prompts and any `evaluate.bench_files`. Speculative and plain decoding run in the same process on
the same turns, so tokens/s figures are comparable; greedy verification must reproduce plain greedy decoding
exactly, and any difference is counted. DSpark adds confidence calibration and dynamic verification
(`draftsmith.evals.evaluation`). Results: `results.json`, `prompts.jsonl`, PNG plots and a Prefect report.
"""

import json
import sys
import tempfile
from pathlib import Path

import torch

from draftsmith.core import storage
from draftsmith.core.caching import stage_task
from draftsmith.core.config import DrafterConfig, EvaluateConfig, TargetConfig
from draftsmith.core.manifest import StageManifest, file_entry
from draftsmith.core.progress import Progress, stage_progress
from draftsmith.core.stage import StageResult, run_stage, stage_key, verify_stage
from draftsmith.drafters import confidence as cal
from draftsmith.drafters import families
from draftsmith.engines import hf
from draftsmith.engines.base import template_hash
from draftsmith.evals import evaluation, loaders, plots, report, suites
from draftsmith.evals.records import BenchPrompt
from draftsmith.tasks.prompt_pool import CATEGORIES
from draftsmith.tasks.select_prompts import read_prompts

STAGE = "evaluate"


def benches_for(cfg: EvaluateConfig, prompts: StageManifest | None, seed: int) -> dict[str, list[BenchPrompt]]:
    """The benchmarks a recipe asks for: held-out prompts, built-in suites, then files."""
    out: dict[str, list[BenchPrompt]] = {}
    if cfg.held_out and prompts is not None:
        held = read_prompts(prompts, "eval")[: cfg.max_prompts]
        out["held-out"] = [BenchPrompt(r.id, r.category, r.turns[:1], r.system, "held-out") for r in held]
    names = list(CATEGORIES) if cfg.suites == ["all"] else cfg.suites
    unknown = [n for n in names if n not in CATEGORIES]
    if unknown:
        raise ValueError(f"evaluate.suites: unknown suites {unknown} (known: {', '.join(CATEGORIES)}, or all)")
    built = suites.builtin_suites(cfg.prompts_per_suite, seed) if names else {}
    out |= {n: built[n] for n in names}
    for name, path in cfg.bench_files.items():
        out[name] = loaders.load_bench(name, path)
    if not out:
        raise ValueError("evaluate: no benchmarks (evaluate.held_out, evaluate.suites and evaluate.bench_files)")
    return out


def headline(kind: str, results: list[dict], g: int) -> dict:
    """The run's summary: acc_len overall and per benchmark, tokens/s, speed-up, mismatches."""
    base = sum(r["tokens_per_s"]["baseline"] * r["seconds"] for r in results) / sum(r["seconds"] for r in results)
    spec = sum(r["tokens_per_s"]["speculative"] * r["seconds"] for r in results) / sum(r["seconds"] for r in results)
    mismatched = [r["mismatched_outputs"] for r in results if r["mismatched_outputs"] is not None]
    return {
        "drafter": kind,
        "draft_tokens_per_round": g,
        "acc_len": {"overall": round(report.overall_acc_len(results), 4)} | {r["bench"]: r["acc_len"] for r in results},
        "tokens_per_s": {"baseline": round(base, 3), "speculative": round(spec, 3)},
        "speedup": round(spec / base, 3),
        "prompts": sum(r["prompts"] for r in results),
        "mismatched_outputs": sum(mismatched) if mismatched else None,
    }


def format_table(results: dict) -> str:
    """The acceptance table that `draftsmith run` prints."""
    lines = [f"{'benchmark':<14}{'acc_len':>9}", "-" * 23]
    for bench, value in results["acc_len"].items():
        if bench != "overall":
            lines.append(f"{bench:<14}{value:>9.3f}")
    lines += ["-" * 23, f"{'overall':<14}{results['acc_len']['overall']:>9.3f}"]
    t = results["tokens_per_s"]
    mismatch = results["mismatched_outputs"]
    lines.append(
        f"tokens/s in the harness, batched: baseline {t['baseline']:.2f}, speculative {t['speculative']:.2f} "
        f"(ratio x{results['speedup']:.2f}, not a serving speed-up); "
        f"{results['prompts']} prompts"
        + (
            f", {mismatch} outputs differ from greedy"
            if mismatch is not None
            else f" at temperature {results['temperature']}"
        )
    )
    return "\n".join(lines)


def render(uri: str, key: str, results: dict) -> list:
    """PNG plots into the stage folder and the Prefect report (inside a flow run); returns their file entries."""
    benches = results["benches"] + results.get("dynamic", [])
    conf = results.get("confidence")
    with tempfile.TemporaryDirectory(prefix="draftsmith-plots-") as tmp:
        paths = {name: str(Path(tmp) / f"{name}.png") for name in ("acc_len_by_bench", "position_acceptance")}
        plots.acc_len_by_bench(benches, paths["acc_len_by_bench"])
        plots.position_acceptance(benches, paths["position_acceptance"])
        if conf:
            paths["reliability"] = str(Path(tmp) / "reliability.png")
            plots.reliability_diagram(
                conf["reliability_after"], paths["reliability"], ece_before=conf["ece_before"],
                ece_after=conf["ece_after"], bins_before=conf["reliability_before"],
            )  # fmt: skip
        report.publish(benches, None, conf, paths, key=f"eval-{key[:12]}")
        return [file_entry(uri, f"{name}.png", Path(path).read_bytes()) for name, path in paths.items()]


def evaluate_checkpoint(
    cfg: EvaluateConfig,
    drafter_cfg: DrafterConfig,
    target: TargetConfig,
    prompts: StageManifest | None,
    checkpoint_uri: str,
    *,
    seed: int,
    uri: str,
    key: str,
    progress: Progress | None = None,
) -> tuple[dict, list]:
    """Evaluate the drafter checkpoint at `checkpoint_uri` (a train stage or an export folder) and write its
    results, per-turn rows, plots and calibration under `uri`; returns `(results, file entries)`."""
    verify_stage(checkpoint_uri)  # a train folder's files must match its manifest; an export folder has none
    family = families.family(drafter_cfg.kind)
    model, tok = hf.load_target(target)
    drafter, taps = family.load(checkpoint_uri, model)
    g = drafter_cfg.drafts_per_round(cfg.num_draft_tokens)
    settings = evaluation.settings_for(
        cfg.temperature, cfg.top_p, cfg.verification, cfg.max_new_tokens, g, seed, cfg.batch_size
    )
    eos = set(hf.end_of_turn_ids(tok, model))
    benches = benches_for(cfg, prompts, seed)
    with torch.inference_mode():
        calibration = drafter_cfg.calibration_prompts(cfg.calibration_prompts)
        out, rows, fitted = evaluation.evaluate_drafter(
            model, tok, family, drafter, taps, kind=drafter_cfg.kind, benches=benches,
            settings=settings, eos=eos, calibration_prompts=calibration, threshold=cfg.confidence_threshold,
            progress=progress,
        )  # fmt: skip
    decoding = {"temperature": cfg.temperature, "top_p": cfg.top_p, "batch_size": cfg.batch_size}
    # The harness renders prompts with the target tokenizer's template and its default thinking mode: recorded,
    # with how many prompts set a system message, so that `draftsmith doctor` can hold them against the data's.
    asked = [p for bench in benches.values() for p in bench]
    template = {"sha256": template_hash(tok.chat_template), "thinking": "template default",
                "system_prompts": sum(1 for p in asked if p.system), "prompts": len(asked)}  # fmt: skip
    results = headline(drafter_cfg.kind, out["benches"], g) | out | decoding | {"chat_template": template}
    files = [
        file_entry(uri, "results.json", (json.dumps(results, indent=2) + "\n").encode()),
        file_entry(uri, "prompts.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode()),
    ]
    if fitted is not None:
        files.append(file_entry(uri, cal.CALIBRATION_FILE, fitted.to_json().encode()))
    return results, files + render(uri, key, results)


def evaluate_key(
    cfg: EvaluateConfig,
    drafter_cfg: DrafterConfig,
    target: TargetConfig,
    prompts: StageManifest,
    checkpoint: StageManifest,
    seed: int = 0,
) -> str:
    """The stage key (`draftsmith.core.stage.stage_key`): sections, prompts, checkpoint and seed; the code is
    this module's and the drafter family's."""
    code = [sys.modules[__name__], *families.code_of(drafter_cfg.kind)]
    # `doctor` only decides whether a report is published: turning it off must not recompute the evaluation.
    cfg = cfg.model_copy(update={"doctor": True})
    inputs = {"cfg": cfg, "drafter": drafter_cfg, "target": target, "prompts": prompts, "checkpoint": checkpoint}
    return stage_key(STAGE, code, **inputs, seed=seed)


def evaluate(
    cfg: EvaluateConfig,
    drafter_cfg: DrafterConfig,
    target: TargetConfig,
    prompts: StageManifest,
    checkpoint: StageManifest,
    *,
    out_uri: str,
    seed: int = 0,
) -> StageManifest:
    """Write `results.json`, per-turn `prompts.jsonl`, plots and (DSpark) `calibration.json` under `out_uri`."""
    key = evaluate_key(cfg, drafter_cfg, target, prompts, checkpoint, seed)

    def compute(uri: str) -> StageResult:
        with stage_progress(STAGE, uri, None, "evaluate: prompts decoded", unit="prompt") as progress:
            results, files = evaluate_checkpoint(
                cfg, drafter_cfg, target, prompts, checkpoint.uri, seed=seed, uri=uri, key=key, progress=progress
            )
        # Named for what it is: the batched in-process tokens/s ratio, not what a serving engine gains.
        metrics = {"acc_len": results["acc_len"]["overall"], "harness_ratio": results["speedup"]}
        return StageResult(files=files, counts={"prompts": results["prompts"]}, metrics=metrics)

    return run_stage(STAGE, out_uri, key, compute)


def read_results(manifest: StageManifest) -> dict:
    return storage.read_json(manifest.path("results.json"))


@stage_task("evaluate", STAGE, key=evaluate_key)
def evaluate_task(
    cfg: EvaluateConfig,
    drafter_cfg: DrafterConfig,
    target: TargetConfig,
    prompts: StageManifest,
    checkpoint: StageManifest,
    run_dir: str,
    seed: int = 0,
) -> StageManifest:
    return evaluate(cfg, drafter_cfg, target, prompts, checkpoint, out_uri=storage.join(run_dir, STAGE), seed=seed)
