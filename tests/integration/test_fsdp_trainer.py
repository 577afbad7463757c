"""The FSDP2 trainer through torchrun on the tiny recipe: 1 vs 2 gloo ranks, SIGKILL and exact resume,
equal work per rank with unequal lengths.

Each case launches `torchrun` for real (2 ranks, 1 thread each on 2 cores); the tiny run's hidden-state store
is shared, so the cases only train.
"""

import logging
import re

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.drafters.training.metrics import read_jsonl
from draftsmith.drafters.training.run import FAULT_ENV
from draftsmith.drafters.training.torchrun import TorchrunError
from draftsmith.tasks.train import train

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def _train(tiny_cfg, tiny_run, out, max_steps=None, **overrides):
    """Train the tiny drafter with `train.<field>` overrides (nested as dicts) into `out`."""
    cfg = tiny_cfg.train.model_copy(update={k: v for k, v in overrides.items() if not isinstance(v, dict)})
    for section, fields in ((k, v) for k, v in overrides.items() if isinstance(v, dict)):
        cfg = cfg.model_copy(update={section: getattr(cfg, section).model_copy(update=fields)})
    c = tiny_cfg
    return train(
        cfg, c.drafter, c.target, c.hidden_states, tiny_run["tokenize"], tiny_run["hidden_states"],
        seed=c.seed, out_uri=str(out), max_steps=max_steps,
    )  # fmt: skip


def _losses(manifest) -> list[float]:
    return [r["loss"] for r in read_jsonl(f"{manifest.uri}/metrics.jsonl")]


@pytest.mark.slow
def test_one_rank_and_two_ranks_trace_the_same_loss_curve(tiny_cfg, tiny_run, tmp_path, caplog):
    """1 rank x 2 micro-batches and 2 ranks x 1 see the same samples per step: same curve, same weights.

    Both stop early (`max_steps`), which must also stop the loaders cleanly on every rank.
    """
    caplog.set_level(logging.INFO)
    common = {"batch_tokens": 256, "epochs": 3, "checkpoint": {"every_steps": 0}, "max_steps": 6}
    one = _train(tiny_cfg, tiny_run, tmp_path / "one", grad_accum=2, **common)
    two = _train(
        tiny_cfg, tiny_run, tmp_path / "two", grad_accum=1, distributed={"nproc_per_node": 2},
        resources={"cpus": 2}, **common,
    )  # fmt: skip
    a, b = _losses(one), _losses(two)
    assert len(a) == len(b) == one.counts["steps"] == 6
    assert two.counts["world_size"] == 2 and one.counts["world_size"] == 1
    assert a == pytest.approx(b, rel=2e-4, abs=1e-5), (a, b)
    assert a[-1] < a[0]
    wa = load_file(f"{one.uri}/model.safetensors")
    wb = load_file(f"{two.uri}/model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert (wa[k].float() - wb[k].float()).abs().max() < 2e-2, k  # bf16 checkpoints of near-equal weights
    # Unequal lengths on two ranks: the plan gave both ranks the same count, so nothing hung.
    counts = {int(r): int(n) for r, n in re.findall(r"rank (\d) trained (\d+) micro-batches", caplog.text)}
    assert counts.keys() >= {0, 1} and counts[0] == counts[1] == two.counts["steps"]


@pytest.mark.slow
def test_sigkill_then_resume_gives_bitwise_the_uninterrupted_weights(tiny_cfg, tiny_run, tmp_path, monkeypatch):
    """Kill every rank (and torchrun) right after the step-4 checkpoint; the rerun resumes there."""
    common = {"batch_tokens": 256, "epochs": 3, "checkpoint": {"every_steps": 2, "keep": 2}}
    two = {"distributed": {"nproc_per_node": 2}, "resources": {"cpus": 2}}
    whole = _train(tiny_cfg, tiny_run, tmp_path / "whole", **common, **two)
    assert whole.counts["steps"] > 5
    monkeypatch.setenv(FAULT_ENV, "5")
    with pytest.raises(TorchrunError):
        _train(tiny_cfg, tiny_run, tmp_path / "killed", **common, **two)
    ckpts = sorted(p.name for p in (tmp_path / "killed" / "checkpoints").iterdir())
    assert ckpts == ["step-00000002", "step-00000004"], ckpts  # rotation kept two
    assert not (tmp_path / "killed" / "model.safetensors").exists()
    monkeypatch.delenv(FAULT_ENV)
    resumed = _train(tiny_cfg, tiny_run, tmp_path / "killed", **common, **two)
    steps = [r["step"] for r in read_jsonl(f"{resumed.uri}/metrics.jsonl")]
    assert steps == list(range(1, whole.counts["steps"] + 1))  # each step once: step 5 was redone, not doubled
    want = load_file(f"{whole.uri}/model.safetensors")
    got = load_file(f"{resumed.uri}/model.safetensors")
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
    assert _losses(resumed) == _losses(whole)
    assert not (tmp_path / "killed" / "checkpoints").exists()  # the consolidated export replaced the shards
