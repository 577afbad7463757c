"""The peer's side of `benchmarks.peer_quality`: speculators' own EAGLE-3 or DFlash training run,
`speculators.train.cli.main` with its defaults (loss, optimizer, LR schedule, norms, vocabulary mapping, anchors,
sequence packing, checkpoints), on the samples `peer_quality` copied out of our hidden-state store.

`.venv-speculators/bin/python -m benchmarks.workers.peer_fit JOB` prints one JSON line: `{"checkpoint": folder,
"steps": optimizer steps run, "epochs", "train_s": seconds in the trainer, "wall_s": seconds from the start of
`main` (model build, vocabulary mapping and checkpoints included), "tokens": packed tokens trained on}`.

JOB (JSON): `family` (`eagle3` or `dflash`, the peer's `speculator_type`), `verifier` (target folder), `data`
(folder of `NNNNN.safetensors` samples and `token_freq.pt`), `save_path`, `taps`, `draft_vocab_size`,
`total_seq_len`, `max_steps`, `threads`, `seed`; for DFlash also `num_layers`, `block_size`, `mask_token_id` (our
drafter's shape; the peer's defaults are 5 layers and blocks of 16).

What differs from `speculators train` on a GPU, each because this runs on a CPU:
- the data loader is the peer's own (`_setup_dataloader`: its multipack sampler, collate, and for EAGLE-3 its
  `shift_batch`) over a dataset of our samples, with no worker processes and no validation split (the peer holds
  out 10 % by default; here both sides train on every sample and are judged on other prompts);
- the trainer's device is the CPU (`get_local_rank` answers "cpu"; on a GPU it is the local rank's device), and
  its step timer's `torch.accelerator.synchronize` does nothing (there is no accelerator to wait for);
- hidden states and compute are fp32 (its default bf16 is an autocast dtype for a GPU), attention is SDPA (flex
  attention on CPU needs torch.compile) and the loss is its eager implementation (the fused one is Triton);
- `epochs` is set to the fewest that hold `max_steps` optimizer steps, so that training stops at the step
  count of our run (`max_steps` also sets the length of its LR schedule, as in the peer).
"""

import json
import sys
import time
from pathlib import Path
from unittest import mock

import torch
from safetensors.torch import load_file

FINISHED: dict = {}


def _dataset_class():
    from speculators.train.data import BaseDataset

    class StoreSamples(BaseDataset):
        """Our samples in the peer's raw format: `input_ids`, `hidden_states` (taps concatenated),
        `verifier_last_hidden_states`, `loss_mask`; the base class adds `lengths` and `position_ids`."""

        def __init__(self, folder: Path, max_len: int, hidden_states_dtype: torch.dtype):
            self.files = sorted(folder.glob("[0-9]*.safetensors"))
            if not self.files:
                raise FileNotFoundError(f"{folder}: no samples")
            super().__init__(max_len, hidden_states_dtype)

        def __len__(self) -> int:
            return len(self.files)

        def _compute_approx_lengths(self) -> list[int]:
            return [int(n) for n in json.loads((self.files[0].parent / "lengths.json").read_text())]

        def _get_raw_data(self, index: int) -> dict:
            x = load_file(str(self.files[index]))
            return {
                "input_ids": x["input_ids"].long()[: self.max_len],
                "hidden_states": x["hidden_states"].to(self.hidden_states_dtype)[: self.max_len],
                "verifier_last_hidden_states": x["last_hidden"].to(self.hidden_states_dtype)[: self.max_len],
                "loss_mask": x["loss_mask"].bool()[: self.max_len],
            }

    return StoreSamples


def _loaders(job: dict):
    """`create_train_val_loaders`' replacement: the peer's loader over our samples, no validation loader."""
    from speculators.train.dataloader import _setup_dataloader

    def create(**kw):
        dataset = _dataset_class()(Path(job["data"]), kw["total_seq_len"], kw["hidden_states_dtype"])
        loader = _setup_dataloader(
            dataset, kw["total_seq_len"], kw["hidden_size"], num_workers=0,
            num_target_layers=kw["num_target_layers"], prefetch_factor=None, preprocess=kw["preprocess"],
            seed=kw["seed"],
        )  # fmt: skip
        return loader, None

    return create


def _trainer_class(max_steps: int):
    from speculators.train.trainer import Trainer

    class StepBoundTrainer(Trainer):
        """The peer's trainer with as many epochs as `max_steps` needs (epoch lengths vary with the packing)."""

        def __init__(self, model, config, train_loader, val_loader=None):
            sampler = train_loader.batch_sampler
            total, epochs = 0, 0
            while total < max_steps:
                sampler.set_epoch(epochs)
                total += len(sampler)
                epochs += 1
            sampler.set_epoch(0)
            super().__init__(model, config._replace(num_epochs=epochs), train_loader, val_loader)
            FINISHED["epochs"] = epochs
            FINISHED["trainer"] = self

    return StepBoundTrainer


def config(job: dict, save_path: Path):
    """The peer's `TrainConfig` from its defaults, with only the data, shape and CPU settings named above."""
    from speculators.train.config import TrainConfig

    flat = {
        "speculator_type": job["family"], "seed": job["seed"], "verifier_name_or_path": job["verifier"],
        "target_layer_ids": job["taps"], "draft_vocab_size": job["draft_vocab_size"],
        "token_freq_path": str(Path(job["data"]) / "token_freq.pt"), "data_path": job["data"],
        "total_seq_len": job["total_seq_len"], "hidden_states_dtype": "float32", "num_workers": 0,
        "draft_attn_impl": "sdpa", "loss_implementation": "eager", "max_steps": job["max_steps"],
        "save_path": str(save_path), "log_dir": str(save_path.parent / "logs"), "on_missing": "raise",
        "hidden_states_path": None,  # the file backend's own flag: unused, the loader above reads our samples
    }  # fmt: skip
    if job["family"] == "dflash":
        flat |= {k: job[k] for k in ("num_layers", "block_size", "mask_token_id")}
    return TrainConfig.from_flat(flat)


def main(path: str) -> None:
    job = json.loads(Path(path).read_text())
    torch.set_num_threads(job["threads"])
    from speculators.train import cli, trainer

    save_path = Path(job["save_path"])
    cfg = config(job, save_path)
    timed = {"train_s": 0.0}
    run_training = trainer.Trainer.run_training

    def timed_training(self):
        start = time.perf_counter()
        try:
            return run_training(self)
        finally:
            timed["train_s"] = time.perf_counter() - start

    start = time.perf_counter()
    with (
        mock.patch.object(cli, "create_train_val_loaders", _loaders(job)),
        mock.patch.object(cli, "Trainer", _trainer_class(job["max_steps"])),
        mock.patch.object(trainer, "get_local_rank", lambda: "cpu"),
        mock.patch.object(trainer.Trainer, "run_training", timed_training),
        # Its step timer synchronises the accelerator; CPU work is synchronous and there is none to ask.
        mock.patch.object(torch.accelerator, "synchronize", lambda *_a, **_k: None),
    ):
        cli.main(cfg)
    wall = time.perf_counter() - start
    t = FINISHED["trainer"]
    last = max((p for p in save_path.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    shift = 1 if job["family"] == "eagle3" else 0
    tokens = trained_tokens(t.train_loader, FINISHED["epochs"], t.global_step, job["total_seq_len"], shift)
    out = {"checkpoint": str(last), "steps": t.global_step, "epochs": FINISHED["epochs"], "train_s": timed["train_s"]}
    print(json.dumps(out | {"wall_s": wall, "tokens": tokens}), flush=True)


def trained_tokens(loader, epochs: int, steps: int, max_len: int, shift: int) -> int:
    """Tokens in the first `steps` packed batches, epoch by epoch (EAGLE-3's `shift_batch` drops `shift` = 1
    token a sample; DFlash keeps them all)."""
    lengths = loader.dataset.approx_lengths
    seen = done = 0
    for epoch in range(epochs):
        loader.batch_sampler.set_epoch(epoch)
        for batch in loader.batch_sampler:
            if done == steps:
                return seen
            seen += min(max_len, sum(lengths[i] - shift for i in batch))
            done += 1
    return seen


if __name__ == "__main__":
    main(sys.argv[1])
