"""How long Prefect's temporary server takes to answer, with the cores idle and kept busy: the measurement behind
the CLI's start-up timeout (`draftsmith/cli.py`, `EPHEMERAL_STARTUP_TIMEOUT_S`).

Each run starts the server `draftsmith run` starts when no `PREFECT_API_URL` is set (a subprocess on a free
loopback port), waits until it answers, and stops it. `--busy N` keeps N
processes spinning on the CPU meanwhile (on 2 cores, N = 4 gives a load of about 6, where Prefect's own 20 s
default was seen to fail). Runs of the levels alternate, so a drift in the machine reaches every level.

Run from the repository root: `python -m benchmarks.prefect_startup [--runs 3] [--busy 0 4]`.
"""

import argparse
import multiprocessing as mp
import os
import statistics
import time


def _spin(stop) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10_000))


def start_once(timeout_s: float) -> float:
    """Seconds from starting a temporary server to its first answer."""
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()
    t0 = time.perf_counter()
    server.start(timeout=int(timeout_s))
    took = time.perf_counter() - t0
    server.stop()
    return took


def measure(busy: int, timeout_s: float) -> float:
    stop = mp.Event()
    spinners = [mp.Process(target=_spin, args=(stop,), daemon=True) for _ in range(busy)]
    for p in spinners:
        p.start()
    try:
        return start_once(timeout_s)
    finally:
        stop.set()
        for p in spinners:
            p.join(timeout=5)


def main() -> None:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # no network here; as the Makefile sets
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="Starts per level.")
    parser.add_argument("--busy", type=int, nargs="+", default=[0, 4], help="Spinning processes per level.")
    parser.add_argument("--timeout-s", type=float, default=600, help="Give up on one start after this long.")
    args = parser.parse_args()
    took: dict[int, list[float]] = {b: [] for b in args.busy}
    for _ in range(args.runs):
        for busy in args.busy:
            took[busy].append(measure(busy, args.timeout_s))
    print(f"{os.cpu_count()} cores")
    print(f"{'busy processes':>14} {'runs':>4} {'median s':>8} {'max s':>6}")
    for busy, times in took.items():
        print(f"{busy:>14} {len(times):>4} {statistics.median(times):>8.1f} {max(times):>6.1f}")


if __name__ == "__main__":
    main()
