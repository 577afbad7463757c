"""Our side of `benchmarks.peer_train`: the trainer's real step (`Trainer.train_step` on the module that
`draftsmith.drafters.training.worker.build` makes, in a process group of one) on the shared inputs.

`python -m benchmarks.workers.peer_ours JOB` (JOB: the JSON `benchmarks.peer_train` writes) prints one JSON line:
`{"step_s": [...], "peak_rss": bytes}` (warm-up steps excluded). Its own process, so that the peak RSS is
this side's alone.
"""

import json
import resource
import sys
import tempfile
import time

import torch
from safetensors.torch import load_file

from draftsmith.core import storage, tensorio
from draftsmith.core.config import load_recipe
from draftsmith.drafters import data
from draftsmith.drafters.training import fsdp
from draftsmith.drafters.training.loop import Micro, Trainer
from draftsmith.drafters.training.worker import TrainJob, build
from draftsmith.transport.sample import HiddenSample


def trainer_for(job: dict, folder: str) -> tuple[Trainer, fsdp.Dist]:
    """The trainer for `job["ours"]` (our drafter config) over the recipe's target, with `job["taps"]`."""
    recipe = load_recipe(job["recipe"])
    train = recipe.train.model_copy(update={"threads": job["threads"]})
    hidden = recipe.hidden_states.model_copy(update={"taps": job["taps"]})
    d = fsdp.init_distributed(train.distributed)
    counts_uri = storage.join(folder, "counts.safetensors")
    storage.write_bytes(counts_uri, tensorio.dumps({"counts": load_file(job["inputs"])["counts"]}))
    spec = TrainJob(
        train=train.model_dump(mode="json"), drafter=job["ours"], target=recipe.target.model_dump(mode="json"),
        hidden_cfg=hidden.model_dump(mode="json"), out_uri=folder, checkpoint_uri=storage.join(folder, "ckpt"),
        counts_uri=counts_uri, key="peer-bench", seed=0,
    )  # fmt: skip
    built = build(spec, d)
    return Trainer(built.module, train, d, job["warmup"] + job["steps"], built.generator), d


def main(path: str) -> None:
    job = json.loads(open(path).read())
    torch.set_num_threads(job["threads"])
    x = load_file(job["inputs"])
    sample = HiddenSample("s0", x["input_ids"][0], x["loss_mask"][0].bool(), x["features"][0], x["last_hidden"][0])
    micro = Micro(data.collate([sample]), 0)
    with tempfile.TemporaryDirectory(prefix="peer-bench-") as folder:
        trainer, _ = trainer_for(job, folder)
    times = []
    for _ in range(job["warmup"] + job["steps"]):
        start = time.perf_counter()
        trainer.train_step([micro])
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"step_s": times[job["warmup"] :], "peak_rss": peak}), flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
