"""Timing shared by the benchmarks (not run by `make bench` itself: the name starts with `_`)."""

import time
from collections.abc import Callable


def best_of(fn: Callable[[], object], repeats: int = 3) -> float:
    """The fastest of `repeats` wall-clock timings of `fn()`, in seconds (the least disturbed by other load)."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)
