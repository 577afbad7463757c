"""Our trainer against speculators (the vLLM project's drafter library) at its CPU shapes, in one run.

`python -m benchmarks.peer_train` (needs `.venv-speculators`: `make .venv-speculators/.installed`).
Per drafter family, the two sides alternate (ours, peer, ours, peer), each step run in its own process so
that its peak RSS is its own: `benchmarks.workers.peer_ours` (our `Trainer.train_step`) under this interpreter,
`benchmarks.workers.peer_step` (the peer's training forward and loss, backward, AdamW) under the peer's venv. Both
train on the same synthetic sample (safetensors file): SmolLM2-135M's target shapes (hidden 576, vocab 49,152),
sequence 1024, batch 1, fp32, 2 threads. EAGLE-3: 1 layer (intermediate 1536, 9 heads, 3 KV heads), draft
vocabulary 8192, 3 taps, TTT 3 and 7. DFlash: block 8, 5 layers, 5 taps. DSpark: block 7, 5 layers, 5 taps,
Markov rank 256. Block drafters draw the same number of anchors per sequence on both sides (`--anchors`,
default 512, the peer's DFlash default). Reported: median step after warm-up over both rounds as tokens/s
(sequence tokens per step), and the peak RSS of each side's process.

`--quick` runs every part at toy sizes on the tiny recipe (the smoke test); figures are then not meaningful.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
PEER_PYTHON = ROOT / ".venv-speculators" / "bin" / "python"
RECIPES = ROOT / "deployments" / "recipes"
GIB = 2**30


def families(quick: bool, anchors: int) -> dict[str, dict]:
    """`{name: {ours: drafter config, peer: peer shapes, taps}}` at the peer's shapes (toy ones with `quick`)."""
    if quick:
        layer: dict[str, Any] = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "intermediate_size": 128}
        dv, blocks, rank, taps3, taps5 = 512, (4, 4), 8, [1, 2, 3], [1, 2, 3]
        n_layers = 2
    else:
        layer = {"num_heads": 9, "num_kv_heads": 3, "head_dim": 64, "intermediate_size": 1536}
        dv, blocks, rank, taps3, taps5 = 8192, (8, 7), 256, [2, 15, 27], [2, 8, 15, 21, 27]
        n_layers = 5
    out: dict[str, dict[str, Any]] = {}
    for depth in (3, 7):
        ours = {"kind": "eagle3", **layer, "draft_vocab_size": dv, "ttt_depth": depth}
        ours |= {"fc_norm": False, "norm_output": False}
        peer = {"family": "eagle3", **layer, "num_layers": 1, "draft_vocab_size": dv, "ttt_steps": depth}
        out[f"EAGLE-3, TTT {depth}"] = {"ours": ours, "peer": peer, "taps": taps3}
    block: dict[str, Any] = {**layer, "num_layers": n_layers, "num_anchors": anchors, "mask_token_id": 2}
    out[f"DFlash, block {blocks[0]}"] = {
        "ours": {"kind": "dflash2", **block, "block_size": blocks[0], "conv_kernel_size": 0, "selector_rank": 0},
        "peer": {"family": "dflash", **block, "block_size": blocks[0]},
        "taps": taps5,
    }
    out[f"DSpark, block {blocks[1]}"] = {
        "ours": {"kind": "dspark", **block, "block_size": blocks[1], "markov_rank": rank},
        "peer": {"family": "dspark", **block, "block_size": blocks[1], "markov_rank": rank},
        "taps": taps5,
    }
    return out


def write_inputs(path: Path, recipe, taps: list[int], seq: int, draft_vocab: int | None) -> None:
    """One synthetic sample (`benchmarks.helpers.train_data.SampleMaker`), its loss-token counts and, for a pruned
    vocabulary, the peer's t2d/d2t built from those counts."""
    from benchmarks.helpers.train_data import SampleMaker, loss_counts
    from draftsmith.core.target_setup import resolve_target
    from draftsmith.drafters import vocab
    from draftsmith.drafters.export import bundle

    embed, _ = bundle.target_weights(resolve_target(recipe.target.source))
    s = SampleMaker(embed, len(taps), seed=0).sample("s0", seq)
    counts = loss_counts([s], recipe.target.vocab_size)
    x = {"input_ids": s.input_ids[None], "loss_mask": s.loss_mask[None].to(torch.uint8)}
    x |= {"features": s.hidden_states[None], "last_hidden": s.last_hidden[None], "counts": counts}
    if draft_vocab:
        d2t, t2d = vocab.build_draft_vocab(counts, draft_vocab)
        x |= {"d2t": d2t, "t2d": t2d.to(torch.uint8)}
    save_file(x, str(path))


def _run(cmd: list[str], timeout: float) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
    return json.loads(lines[-1])


def compare(name: str, fam: dict, job: dict, folder: Path, rounds: int, timeout: float) -> dict:
    """Alternate the two sides `rounds` times; medians over every timed step of each side."""
    path = folder / f"{name.replace(', ', '-').replace(' ', '')}.json"
    path.write_text(json.dumps(job | fam))
    sides = {"ours": [sys.executable, "-m", "benchmarks.workers.peer_ours", str(path)]}
    sides["peer"] = [str(PEER_PYTHON), "-m", "benchmarks.workers.peer_step", str(path)]
    steps: dict[str, list[float]] = {"ours": [], "peer": []}
    peaks: dict[str, int] = {"ours": 0, "peer": 0}
    for _ in range(rounds):
        for side, cmd in sides.items():
            r = _run(cmd, timeout)
            steps[side] += r["step_s"]
            peaks[side] = max(peaks[side], r["peak_rss"])
    tokens = job["seq"]
    rate = {side: tokens / statistics.median(s) for side, s in steps.items()}
    return {
        "ours_tokens_per_s": rate["ours"],
        "peer_tokens_per_s": rate["peer"],
        "ratio": rate["ours"] / rate["peer"],
        "ours_peak_rss_gib": peaks["ours"] / GIB,
        "peer_peak_rss_gib": peaks["peer"] / GIB,
        "steps_per_side": len(steps["ours"]),
    }


def run(*, quick: bool, anchors: int, rounds: int, steps: int, warmup: int, threads: int, only: str | None) -> dict:
    from draftsmith.core.config import load_recipe
    from draftsmith.core.target_setup import resolve_target

    recipe_path = RECIPES / ("tiny-cpu.yaml" if quick else "smollm2-cpu-eagle3.yaml")
    recipe = load_recipe(recipe_path)
    seq = 64 if quick else 1024
    verifier = str(resolve_target(recipe.target.source))
    shapes = {"hidden_size": recipe.target.hidden_size, "vocab_size": recipe.target.vocab_size}
    out = {}
    with tempfile.TemporaryDirectory(prefix="peer-train-") as tmp:
        folder = Path(tmp)
        for name, fam in families(quick, anchors).items():
            if only and only.lower() not in name.lower():
                continue
            inputs = folder / f"{len(fam['taps'])}-{fam['peer'].get('draft_vocab_size')}.safetensors"
            if not inputs.exists():
                write_inputs(inputs, recipe, fam["taps"], seq, fam["peer"].get("draft_vocab_size"))
            fam = fam | {"peer": fam["peer"] | shapes}
            job = {"recipe": str(recipe_path), "inputs": str(inputs), "verifier": verifier, "seq": seq}
            job |= {"threads": threads, "steps": steps, "warmup": warmup}
            out[name] = compare(name, fam, job, folder, rounds, timeout=3600)
            print(row(name, out[name]), flush=True)
    return {"families": out, "seq": seq, "anchors": anchors, "threads": threads, "rounds": rounds, "steps": steps}


HEADER = f"{'drafter':<18}{'ours tok/s':>11}{'peer tok/s':>11}{'ratio':>7}{'ours RSS':>10}{'peer RSS':>10}"


def row(name: str, r: dict) -> str:
    return (
        f"{name:<18}{r['ours_tokens_per_s']:>11.1f}{r['peer_tokens_per_s']:>11.1f}{r['ratio']:>6.2f}x"
        f"{r['ours_peak_rss_gib']:>8.2f} G{r['peer_peak_rss_gib']:>8.2f} G"
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="Toy sizes on the tiny recipe (smoke test).")
    parser.add_argument("--anchors", type=int, default=512, help="Anchors per sequence for block drafters.")
    parser.add_argument("--rounds", type=int, default=2, help="Alternations of the two sides per family.")
    parser.add_argument("--steps", type=int, default=2, help="Timed steps per side per round.")
    parser.add_argument("--warmup", type=int, default=1, help="Untimed steps first, per process.")
    parser.add_argument("--threads", type=int, default=2, help="torch threads on each side.")
    parser.add_argument("--only", help="Only the families whose name contains this (e.g. dspark).")
    parser.add_argument("--json", help="Also write the figures to this JSON file.")
    args = parser.parse_args(argv)
    anchors = 8 if args.quick and args.anchors == 512 else args.anchors
    if not PEER_PYTHON.exists():
        # `make bench` runs every benchmark; this one needs the peer's venv, which `make test` builds.
        print(f"skipped: no speculators environment at {PEER_PYTHON} (make .venv-speculators/.installed)")
        return {}
    print(HEADER, flush=True)
    result = run(quick=args.quick, anchors=anchors, rounds=args.rounds, steps=args.steps, warmup=args.warmup,
                 threads=args.threads, only=args.only)  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
