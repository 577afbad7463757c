"""Learning-rate schedules as multiplicative factors of the peak LR, for `torch.optim.lr_scheduler.LambdaLR`.

`step` is the 0-based optimizer step the factor applies to (LambdaLR calls the lambda with 0 before the first
step). Every schedule starts with a linear warm-up `(step + 1) / warmup`, so the last warm-up step trains at
the peak LR and no step trains at LR 0. After the warm-up, with `D = total - warmup` steps left:

- `constant`: 1.0.
- `linear`:   1.0 on the first post-warm-up step down to `min_ratio` on the last step (`total - 1`).
- `cosine`:   half a cosine between the same two endpoints.
- `wsd`:      warmup-stable-decay: 1.0, then a linear decay over the last `round(decay_fraction * D)` steps
              (at least one) that ends at `min_ratio` on the last step.

A warm-up longer than the run is cut to the run (`warmup = total`: the run ends at the peak LR, nothing
decays). Steps past the end keep the last step's factor, so one extra `scheduler.step()` after the final
optimizer step is harmless.
"""

import functools
import math
from collections.abc import Callable

from draftsmith.core.config.train import TrainConfig

KINDS = ("cosine", "linear", "constant", "wsd")


def lr_factor(step: int, *, kind: str, warmup: int, total: int, min_ratio: float, decay_fraction: float) -> float:
    """The LR multiplier (peak = 1.0) for 0-based optimizer `step` of a `total`-step run."""
    if kind not in KINDS:
        raise ValueError(f"schedule: unknown kind {kind!r}; expected one of {', '.join(KINDS)}")
    if total < 1:
        raise ValueError(f"schedule: total steps must be >= 1, got {total}")
    if warmup < 0:
        raise ValueError(f"schedule: warmup must be >= 0, got {warmup}")
    if step < 0:
        raise ValueError(f"schedule: step must be >= 0, got {step}")
    if not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"schedule: min_ratio must lie in [0, 1], got {min_ratio}")
    if not 0.0 < decay_fraction <= 1.0:
        raise ValueError(f"schedule: decay_fraction must lie in (0, 1], got {decay_fraction}")
    warmup = min(warmup, total)
    step = min(step, total - 1)
    if step < warmup:
        return (step + 1) / warmup
    if kind == "constant":
        return 1.0
    t = step - warmup  # 0 .. D-1
    span = total - warmup
    if kind == "wsd":
        decay = max(1, round(decay_fraction * span))
        stable = span - decay
        if t < stable:
            return 1.0
        # The step before the decay trains at 1.0 (stable or warm-up end), the last at min_ratio. Written as
        # min + (1 - min) * remaining so the last step is min_ratio exactly, not min_ratio - 1 ulp.
        return min_ratio + (1.0 - min_ratio) * (decay - (t - stable + 1)) / decay
    # A lone post-warm-up step is both first and last; it keeps the peak rather than jumping to the floor.
    progress = t / (span - 1) if span > 1 else 0.0
    if kind == "linear":
        return min_ratio + (1.0 - min_ratio) * (1.0 - progress)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def lr_lambda(cfg: TrainConfig, total_steps: int) -> Callable[[int], float]:
    """The `cfg` schedule for a `total_steps`-step run, as a `LambdaLR` lambda.

    A `functools.partial` of a module function rather than a closure: LambdaLR's `state_dict` stores a
    callable object's `__dict__` (empty here) and skips plain functions, so checkpoints stay data-only.
    """
    if total_steps < 1:
        raise ValueError(f"schedule: total_steps must be >= 1, got {total_steps}")
    return functools.partial(
        lr_factor,
        kind=cfg.schedule,
        warmup=cfg.warmup_steps,
        total=total_steps,
        min_ratio=cfg.min_lr_ratio,
        decay_fraction=cfg.wsd_decay_fraction,
    )
