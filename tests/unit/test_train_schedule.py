"""LR schedule shapes: warm-up, exact endpoints, monotone decay, WSD phases, and LambdaLR integration."""

import itertools
import math

import pytest
import torch

from draftsmith.core.config.train import TrainConfig
from draftsmith.drafters.training.schedule import lr_factor, lr_lambda

pytestmark = pytest.mark.unit


def _curve(kind: str, *, warmup: int = 4, total: int = 24, min_ratio: float = 0.1, frac: float = 0.25) -> list[float]:
    return [
        lr_factor(s, kind=kind, warmup=warmup, total=total, min_ratio=min_ratio, decay_fraction=frac)
        for s in range(total)
    ]


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant", "wsd"])
def test_warmup_is_linear_and_reaches_peak(kind):
    c = _curve(kind)
    assert c[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0], abs=1e-12)
    assert c[4] == pytest.approx(1.0, abs=1e-12)
    assert min(c) > 0.0 and max(c) <= 1.0


@pytest.mark.parametrize("kind", ["cosine", "linear", "wsd"])
def test_decay_is_monotone_and_ends_exactly_at_min_ratio(kind):
    c = _curve(kind, min_ratio=0.1)
    post = c[4:]
    assert all(a >= b for a, b in itertools.pairwise(post)), post
    assert c[-1] == 0.1
    # Steps past the end (an extra scheduler.step()) keep the final factor.
    assert lr_factor(24, kind=kind, warmup=4, total=24, min_ratio=0.1, decay_fraction=0.25) == 0.1
    assert lr_factor(1000, kind=kind, warmup=4, total=24, min_ratio=0.1, decay_fraction=0.25) == 0.1


def test_cosine_midpoint_and_linear_values():
    # 4 warm-up + 21 decay steps: t = 0..20, the midpoint t = 10 is exactly halfway.
    cos = _curve("cosine", total=25, min_ratio=0.0)
    lin = _curve("linear", total=25, min_ratio=0.2)
    assert cos[14] == pytest.approx(0.5, abs=1e-12)
    assert cos[9] == pytest.approx(0.5 * (1 + math.cos(math.pi * 5 / 20)), abs=1e-12)
    assert lin[14] == pytest.approx(0.6, abs=1e-12)
    assert lin[9] == pytest.approx(1.0 - 0.8 * 5 / 20, abs=1e-12)
    assert cos[-1] == 0.0


def test_constant_stays_at_peak():
    assert _curve("constant")[4:] == [1.0] * 20


def test_wsd_stable_then_linear_decay_over_the_last_fraction():
    # 20 post-warm-up steps, decay_fraction 0.25: 15 stable steps at 1.0, then 5 decay steps to 0.1.
    c = _curve("wsd", min_ratio=0.1, frac=0.25)
    assert c[4:19] == [1.0] * 15
    expected = [1.0 - 0.9 * k / 5 for k in range(1, 6)]
    assert c[19:] == pytest.approx(expected, abs=1e-12)
    assert c[-1] == 0.1


def test_wsd_with_full_decay_fraction_matches_a_decay_from_the_warmup_peak():
    c = _curve("wsd", warmup=2, total=6, min_ratio=0.0, frac=1.0)
    assert c == pytest.approx([0.5, 1.0, 0.75, 0.5, 0.25, 0.0], abs=1e-12)


def test_warmup_longer_than_run_is_cut_to_the_run():
    c = _curve("cosine", warmup=50, total=5)
    assert c == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0], abs=1e-12)
    assert _curve("linear", warmup=0, total=1) == [1.0]  # a lone step keeps the peak
    assert _curve("wsd", warmup=0, total=1) == [0.1]  # wsd always decays over at least one step
    assert _curve("linear", warmup=3, total=4, min_ratio=0.5) == pytest.approx([1 / 3, 2 / 3, 1.0, 1.0])


def test_no_warmup_starts_at_peak():
    assert _curve("linear", warmup=0, total=3, min_ratio=0.0) == pytest.approx([1.0, 0.5, 0.0])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kind": "step"}, "unknown kind 'step'"),
        ({"total": 0}, "total steps"),
        ({"warmup": -1}, "warmup"),
        ({"min_ratio": 1.5}, "min_ratio"),
        ({"decay_fraction": 0.0}, "decay_fraction"),
    ],
)
def test_bad_arguments_name_the_field(kwargs, match):
    args = {"kind": "cosine", "warmup": 1, "total": 10, "min_ratio": 0.1, "decay_fraction": 0.2} | kwargs
    with pytest.raises(ValueError, match=match):
        lr_factor(0, **args)
    with pytest.raises(ValueError, match="step must be"):
        lr_factor(-1, kind="cosine", warmup=1, total=10, min_ratio=0.1, decay_fraction=0.2)


def test_lr_lambda_drives_lambdalr_and_survives_state_dict():
    cfg = TrainConfig(lr=2e-3, schedule="linear", warmup_steps=2, min_lr_ratio=0.25)
    total = 6
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=cfg.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg, total))
    seen = []
    for _ in range(total):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([1e-3, 2e-3, 2e-3, 1.5e-3, 1e-3, 5e-4], rel=1e-12)
    # A resumed scheduler continues from the saved step.
    state = sched.state_dict()
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lr_lambda(cfg, total))
    sched2.load_state_dict(state)
    assert state["lr_lambdas"] == [{}]  # data only: nothing of the partial's function is pickled
    assert sched2.last_epoch == total
    assert sched2.get_last_lr() == pytest.approx([5e-4])
    with pytest.raises(ValueError, match="total_steps"):
        lr_lambda(cfg, 0)
