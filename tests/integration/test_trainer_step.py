"""The optimizer step in-process (a process group of one): non-finite steps skipped on device and counted,
a run of them failing clearly, and bf16 mixed precision for every drafter family.

The module is built exactly as a torchrun rank builds it (`draftsmith.drafters.training.worker.build`: meta layout,
real weights on rank 0, FSDP2 units, broadcast), from the tiny recipe's target.
"""

import functools
import math

import pytest
import torch
from torch.distributed.tensor import DTensor

from draftsmith.core import storage, tensorio
from draftsmith.core.config.drafter import parse_drafter
from draftsmith.drafters.training import fsdp
from draftsmith.drafters.training.loop import Micro, NonFiniteError, Trainer
from draftsmith.drafters.training.target_parts import load_target_parts, target_head
from draftsmith.drafters.training.worker import TrainJob, build
from tests.support.models import FAMILY_CASES as CASES

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def group():
    from draftsmith.core.config.train import DistributedConfig

    d = fsdp.init_distributed(DistributedConfig())
    yield d
    torch.distributed.destroy_process_group()


def _job(tiny_cfg, tmp_path, drafter: dict | None = None, **train) -> TrainJob:
    counts = tmp_path / "counts.safetensors"
    V = tiny_cfg.target.vocab_size
    storage.write_bytes(str(counts), tensorio.dumps({"counts": torch.arange(V, 0, -1)}))
    drafter_cfg = parse_drafter(drafter) if drafter else tiny_cfg.drafter
    return TrainJob(
        train=tiny_cfg.train.model_validate(tiny_cfg.train.model_dump() | train).model_dump(mode="json"),
        drafter=drafter_cfg.model_dump(mode="json"),
        target=tiny_cfg.target.model_dump(mode="json"),
        hidden_cfg=tiny_cfg.hidden_states.model_dump(mode="json"),
        out_uri=str(tmp_path),
        checkpoint_uri=str(tmp_path / "ckpt"),
        counts_uri=str(counts),
        key="k" * 64,
        seed=0,
    )


def _batch(tiny_cfg, seed: int, B: int = 2, S: int = 24) -> dict[str, torch.Tensor]:
    """Synthetic micro-batch with the collated shapes: ids/masks `[B, S]`, features `[B, S, N*H]`.

    The last hidden state points along the target head's row of the next token, so the target's argmax
    is that token, inside the 512-id draft vocabulary (the most frequent ids by the fixture's counts).
    """
    g = torch.Generator().manual_seed(seed)
    H, N = tiny_cfg.target.hidden_size, len(tiny_cfg.hidden_states.taps)
    loss = torch.zeros(B, S, dtype=torch.bool)
    loss[:, S // 3 :] = True
    ids = torch.randint(0, 500, (B, S), generator=g)
    head = target_head(_parts(tiny_cfg))
    return {
        "input_ids": ids,
        "loss_mask": loss,
        "in_draft": torch.zeros(B, S, dtype=torch.bool),
        "features": torch.randn(B, S, N * H, generator=g),
        "last_hidden": 8 * head[ids.roll(-1, dims=1)] / head[ids.roll(-1, dims=1)].norm(dim=-1, keepdim=True),
    }


@functools.cache
def _parts_cached(target_json: str):
    from draftsmith.core.config import TargetConfig

    return load_target_parts(TargetConfig.model_validate_json(target_json), materialize=True)


def _parts(tiny_cfg):
    return _parts_cached(tiny_cfg.target.model_dump_json())


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded parameter."""
    shard = p.detach()
    assert isinstance(shard, DTensor)
    return shard.to_local()


def _trainer(tiny_cfg, tmp_path, d, drafter=None, **train) -> Trainer:
    job = _job(tiny_cfg, tmp_path, drafter, **train)
    built = build(job, d)
    from draftsmith.core.config.train import TrainConfig

    return Trainer(built.module, TrainConfig.model_validate(job.train), d, 20, built.generator)


def _poisoned(trainer: Trainer, steps: set[int]) -> None:
    """Make the objective's loss NaN on the given (1-based) optimizer steps."""
    real = trainer.module.objective

    def objective(model, batch):
        out = real(model, batch)
        if trainer.step + 1 in steps:
            return type(out)(out.total * math.nan, out.step_loss, out.step_acc, out.step_count)
        return out

    trainer.module.objective = objective


def test_a_nan_step_is_skipped_without_touching_weights_or_optimizer_and_counted(tiny_cfg, tmp_path, group):
    trainer = _trainer(tiny_cfg, tmp_path, group)
    assert trainer.fused  # CPU has a fused AdamW kernel: the skip happens inside it
    _poisoned(trainer, {3})
    records, snapshots = [], []
    for step in range(1, 6):
        snapshots.append([_local(p).clone() for p in trainer.params])
        records.append(trainer.train_step([Micro(_batch(tiny_cfg, step), seed=step)]))
        if step == 3:
            after = [_local(p) for p in trainer.params]
            assert all(torch.equal(a, b) for a, b in zip(snapshots[-1], after, strict=True))
            steps = {int(s["step"]) for s in trainer.opt.state.values()}
            assert steps == {2}  # the fused kernel rolled its step count back
    records.append(trainer.flush())
    done = [r for r in records if r is not None]
    assert [r["step"] for r in done] == [1, 2, 3, 4, 5]
    assert [r["skipped"] for r in done] == [False, False, True, False, False]
    assert [r["skipped_steps"] for r in done] == [0, 0, 1, 1, 1]
    assert not math.isfinite(done[2]["loss"]) and math.isfinite(done[3]["loss"])
    moved = [_local(p) for p in trainer.params]
    assert any(not torch.equal(a, b) for a, b in zip(snapshots[3], moved, strict=True))  # training went on


def test_a_run_of_non_finite_steps_fails_naming_the_limit(tiny_cfg, tmp_path, group):
    trainer = _trainer(tiny_cfg, tmp_path, group, max_consecutive_skips=3)
    _poisoned(trainer, set(range(1, 100)))
    with pytest.raises(NonFiniteError, match=r"3 optimizer steps in a row.*train\.max_consecutive_skips = 3"):
        for step in range(1, 8):
            trainer.train_step([Micro(_batch(tiny_cfg, step), seed=step)])
    assert trainer.step == 4  # noticed one step late: the host never waited for the device


@pytest.mark.parametrize("kind", sorted(CASES))
def test_bf16_mixed_precision_trains_every_family_with_fp32_masters(kind, tiny_cfg, tmp_path, group):
    mp = {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    trainer = _trainer(tiny_cfg, tmp_path, group, CASES[kind][0], mixed_precision=mp)
    assert {p.dtype for p in trainer.params} == {torch.float32}  # the optimizer's master shards
    first = [_local(p).clone() for p in trainer.params]
    for step in range(1, 3):
        trainer.train_step([Micro(_batch(tiny_cfg, step), seed=step)])
    last = trainer.flush()
    assert last is not None
    assert math.isfinite(last["loss"]) and not last["skipped"] and last["grad_norm"] > 0
    assert any(not torch.equal(a, _local(p)) for a, p in zip(first, trainer.params, strict=True))
