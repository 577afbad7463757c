"""Fault scenarios, each run N times: what was lost, duplicated or corrupted, and how fast the fault was
noticed (a retry after a failed request, a refusal of a poisoned checkpoint, a killed or stopped rank named,
a dead Mooncake master named, the children of a killed process gone, a lost dispatched stage marked Crashed,
a killed holder's GPU slots given back), and how many global-concurrency slots stayed taken.

Run from the repository root: `python -m benchmarks.faults [--runs N] [--only NAME ...]`.
"""

import argparse
import logging
import warnings
from collections.abc import Callable

from tests.support.faults import orchestration, servers, storage, stream
from tests.support.faults.result import FaultResult

SCENARIOS: dict[str, Callable[..., FaultResult]] = {
    **servers.SCENARIOS, **storage.SCENARIOS, **stream.SCENARIOS, **orchestration.SCENARIOS,
}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="Runs per scenario (each with its own seed).")
    parser.add_argument("--only", nargs="*", choices=sorted(SCENARIOS), help="Scenarios to run (default: all).")
    args = parser.parse_args()
    # Every injected fault logs a retry warning: the table is the output.
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    head = ("fault", "runs", "injected", "lost", "duplicated", "corrupted", "detected-within s", "slots leaked")
    print(f"{head[0]:<34} " + " ".join(f"{h:>{max(len(h), 4)}}" for h in head[1:]))
    failed = False
    for name in args.only or SCENARIOS:
        results: list[FaultResult] = []
        for run in range(args.runs):
            fn = SCENARIOS[name]
            results.append(fn(seed=run) if name == "flaky-endpoint" else fn())
        lost = sum(r.lost for r in results)
        dup = sum(r.duplicated for r in results)
        bad = sum(r.corrupted for r in results)
        leaked = sum(r.slots_leaked for r in results)
        failed |= bool(lost or dup or bad or leaked)
        print(
            f"{results[0].fault:<34} {len(results):>4} {sum(r.injected for r in results):>8} {lost:>4} {dup:>10} "
            f"{bad:>9} {max(r.detected_within_s for r in results):>17.3f} {leaked:>12}"
        )
    if failed:
        raise SystemExit("faults: some scenario lost, duplicated or corrupted data, or leaked a concurrency slot")


if __name__ == "__main__":
    main()
