"""How much `draftsmith speedup`'s figures move between runs of the same measurement on the same machine.

Runs the speed-up measurement of a finished run `--repeat` times (each with `--force`, so each measures anew),
then prints, per concurrency and server, every run's speed-up over plain serving and the spread
(max / min - 1). The table's figures are meant to repeat within ±5 % on an idle machine; the load columns say
whether the machine was. Flags after `--` go to `draftsmith speedup` unchanged, so methods can be compared:

    python -m benchmarks.speedup_repeat runs/smollm2-cpu-eagle3 --repeat 2
    python -m benchmarks.speedup_repeat runs/smollm2-cpu-eagle3 --repeat 2 -- --concurrency 4 --waves 2

Each repeat takes as long as one `draftsmith speedup` (about ten minutes for the embedded default's table on
two cores). The results go to `<run>/speedup/repeat-<i>.json`.
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

from draftsmith import cli

SPREAD_GOAL = 0.05
# The embedded default's run; `make bench` makes it first (benchmarks/drafters_acc_len.py).
DEFAULT_RUN = Path(__file__).resolve().parents[1] / "runs" / "smollm2-cpu-eagle3"


def measure(run: Path, flags: list[str], repeat: int) -> list[dict]:
    results = []
    for i in range(repeat):
        if cli.main(["speedup", str(run), "--force", *flags]) != 0:
            raise SystemExit(f"speedup_repeat: draftsmith speedup failed on repeat {i}")
        saved = run / "speedup" / f"repeat-{i}.json"
        shutil.copyfile(run / "speedup" / "speedup.json", saved)
        results.append(json.loads(saved.read_text()))
    return results


def spread_table(results: list[dict]) -> tuple[list[str], float]:
    """Markdown rows: level, server, each run's speed-up, the spread; and the largest spread."""
    figures: dict[tuple[int, str], list[float]] = {}
    busy: dict[tuple[int, str], bool] = {}
    for result in results:
        for row in result["levels"]:
            key = (row["concurrency"], row.get("server") or "drafter")
            figures.setdefault(key, []).append(row["speedup"])
            busy[key] = busy.get(key, False) or bool((row.get("load") or {}).get("busy"))
    lines = ["| concurrency | server | speed-up per run | spread | busy machine |", "|---:|---|---|---:|---|"]
    worst = 0.0
    for (c, server), values in figures.items():
        spread = max(values) / min(values) - 1 if min(values) > 0 else float("inf")
        worst = max(worst, spread)
        runs = ", ".join(f"×{v:.2f}" for v in values)
        lines.append(f"| {c} | {server} | {runs} | {spread:.1%} | {'yes' if busy[(c, server)] else 'no'} |")
    return lines, worst


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "run", type=Path, nargs="?", default=DEFAULT_RUN, help=f"a finished run (default {DEFAULT_RUN})"
    )
    parser.add_argument("--repeat", type=int, default=2, help="measurements to compare (default 2)")
    parser.epilog = "Flags after -- go to draftsmith speedup."
    argv = sys.argv[1:] if argv is None else argv
    # Split at `--` by hand: argparse's REMAINDER after an optional positional would also swallow `--repeat`.
    ours, flags = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    args = parser.parse_args(ours)
    if not (args.run / "train" / "manifest.json").exists():
        raise SystemExit(f"speedup_repeat: {args.run} holds no trained drafter; run its recipe first")
    lines, worst = spread_table(measure(args.run, flags, args.repeat))
    print("\n".join(lines))
    print(f"largest spread {worst:.1%} (goal: within {SPREAD_GOAL:.0%} on an idle machine)")


if __name__ == "__main__":
    main()
