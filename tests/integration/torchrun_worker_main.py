"""Fixture worker for tests/integration/test_torchrun_launch.py: 2 gloo ranks, one all_reduce.

`--mode ok` prints each rank's view and the all_reduce sum; `--mode raise` makes rank 1 raise
ValueError; `--mode hang` makes rank 1 ignore SIGTERM and sleep (rank 0 then waits in the collective),
so the launcher's timeout has to escalate to SIGKILL to leave no process behind.
"""

import argparse
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


def _fail_at_rank_1(rank: int) -> None:
    if rank == 1:
        raise ValueError("boom at rank 1")


@record
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["ok", "raise", "hang"], default="ok")
    mode = parser.parse_args().mode
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    print(
        f"worker rank={rank} world={world} pid={os.getpid()} omp={os.environ.get('OMP_NUM_THREADS')} "
        f"threads={os.environ.get('DRAFTSMITH_THREADS')}",
        flush=True,
    )
    if mode == "raise":
        _fail_at_rank_1(rank)
    if mode == "hang" and rank == 1:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(600)
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    print(f"all_reduce rank={rank} sum={value.item():g}", flush=True)
    dist.destroy_process_group()
    sys.exit(0)


if __name__ == "__main__":
    main()
