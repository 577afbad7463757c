"""GPU slots: a stage on a GPU pool holds one slot of the pool's global concurrency limit per GPU it uses.

The limits are named `gpu:<pool>`; `draftsmith deploy` creates them (`draftsmith.pools.gpu_limit_commands`).

Slots are held under a Prefect concurrency lease that the holder renews in the background. A stage killed
while it holds slots (its node lost, SIGKILL) stops renewing, and the server's repossessor gives the slots
back once the lease has expired: within `SLOT_LEASE_S` plus the repossessor's loop
(`PREFECT_SERVER_SERVICES_REPOSSESSOR_LOOP_SECONDS`, 15 s by default), instead of Prefect's default 300 s
lease during which every other run on the pool would wait for GPUs nobody uses.
"""

from collections.abc import Iterator
from contextlib import contextmanager

from draftsmith.core.config import Resources

# Global concurrency limits for GPUs are named `<GPU_CONCURRENCY_LIMIT>:<pool>`; one slot = one GPU.
GPU_CONCURRENCY_LIMIT = "gpu"
# The shortest lease Prefect's server accepts. Prefect renews it at three quarters (45 s), so a renewal may be
# late by 15 s (a busy server) before the slots are given up under a live stage.
SLOT_LEASE_S = 60.0


def gpu_limit_name(pool: str) -> str:
    """Name of the global concurrency limit that counts the GPUs of `pool`."""
    return f"{GPU_CONCURRENCY_LIMIT}:{pool}"


@contextmanager
def gpu_slots(resources: Resources) -> Iterator[None]:
    """Hold `gpus * nodes` slots of the pool's `gpu:<pool>` limit while the block runs (none on CPU pools).

    Strict: on a GPU pool whose limit was never created, this fails with Prefect's error instead of
    silently oversubscribing the GPUs.
    """
    need = resources.gpus * resources.nodes
    if need == 0:
        yield
        return
    from prefect.concurrency.sync import concurrency

    with concurrency(gpu_limit_name(resources.work_pool), occupy=need, strict=True, lease_duration=SLOT_LEASE_S):
        yield
