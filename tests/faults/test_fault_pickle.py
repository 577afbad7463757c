"""Resume reads a DCP checkpoint without unrestricted unpickling: a genuine checkpoint saved by the
trainer's save path resumes, while a `.metadata` or a non-tensor entry replaced by a pickle that would run
code is refused, naming the file, and the code never runs."""

import pathlib
import pickle
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from draftsmith.drafters.training.checkpoint import Checkpoints, UnsafeCheckpointError, load_dcp
from draftsmith.drafters.training.fsdp import Dist

pytestmark = pytest.mark.unit


class _Touch:
    """Unpickling it creates `marker`: a stand-in for `os.system`."""

    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


class _Trainer:
    """What `Checkpoints` uses of the trainer: a module, its optimizer and JSON-able counters."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        self.opt = torch.optim.AdamW(self.module.parameters(), lr=1e-3, betas=(0.8, 0.95))
        self.step = 0

    def train_step(self) -> None:
        self.module(torch.randn(2, 4)).square().sum().backward()
        self.opt.step()
        self.step += 1

    def state(self) -> dict:
        return {"step": self.step}

    def load_state(self, state: dict) -> None:
        self.step = state["step"]


@pytest.fixture
def checkpoints(tmp_path):
    # `Checkpoints.save` is collective: a process group of one, gone again before the next test.
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg-store'}", rank=0, world_size=1)
    try:
        yield Checkpoints(str(tmp_path / "ckpt"), keep=2, d=Dist(0, 1, 0, torch.device("cpu")))
    finally:
        dist.destroy_process_group()


def _saved(checkpoints: Checkpoints) -> tuple[_Trainer, str]:
    trainer = _Trainer(seed=0)
    for _ in range(2):
        trainer.train_step()
    stand_in: Any = trainer  # what Checkpoints.save reads of a Trainer: its state and step
    return trainer, checkpoints.save(stand_in)


def test_a_genuine_checkpoint_resumes_through_the_restricted_readers(checkpoints):
    saved, url = _saved(checkpoints)
    fresh = _Trainer(seed=1)
    assert checkpoints.resume(fresh) == 2 and fresh.step == 2
    for a, b in zip(saved.module.parameters(), fresh.module.parameters(), strict=True):
        assert torch.equal(a, b)
    want, got = saved.opt.state_dict(), fresh.opt.state_dict()
    assert got["param_groups"][0]["betas"] == (0.8, 0.95) and got["param_groups"] == want["param_groups"]
    for k, state in want["state"].items():
        for name, value in state.items():
            assert torch.equal(got["state"][k][name], value)


def test_a_metadata_pickle_that_runs_code_is_refused(checkpoints, tmp_path):
    _, url = _saved(checkpoints)
    marker = tmp_path / "pwned"
    (pathlib.Path(url) / ".metadata").write_bytes(pickle.dumps(_Touch(marker)))
    with pytest.raises(
        UnsafeCheckpointError, match=r"\.metadata: refusing .*pathlib\.Path\.touch is not part of DCP metadata"
    ):
        checkpoints.resume(_Trainer(seed=1))
    assert not marker.exists()
    # Torch's own reader would have run it: what the restricted reader protects against.
    # (CheckpointException is a BaseException; the payload is not Metadata, so torch fails after running it)
    with pytest.raises(BaseException, match="storage_meta"):
        dcp.load({"x": torch.zeros(1)}, storage_reader=dcp.FileSystemReader(url))
    assert marker.exists()


def test_a_non_tensor_entry_that_runs_code_is_refused(checkpoints, tmp_path):
    _, url = _saved(checkpoints)
    marker = tmp_path / "pwned"
    # Non-tensor entries (the optimizer's param groups) are torch.save'd into the shard file: write the
    # same checkpoint again with one of them poisoned.
    trainer = _Trainer(seed=0)
    state = checkpoints._state(trainer)
    state["optim"]["param_groups"][0]["lr"] = _Touch(marker)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(url))
    with pytest.raises(UnsafeCheckpointError, match=r"refusing to load checkpoint entry '.*lr'"):
        checkpoints.resume(_Trainer(seed=1))
    assert not marker.exists()


def test_load_dcp_refuses_a_metadata_file_that_is_not_metadata(tmp_path):
    folder = tmp_path / "ck"
    dcp.save({"x": torch.arange(3.0)}, storage_writer=dcp.FileSystemWriter(str(folder)))
    state = {"x": torch.zeros(3)}
    load_dcp(state, str(folder))
    assert torch.equal(state["x"], torch.arange(3.0))
    (folder / ".metadata").write_bytes(pickle.dumps({"not": "metadata"}))
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata: holds a dict"):
        load_dcp({"x": torch.zeros(3)}, str(folder))
