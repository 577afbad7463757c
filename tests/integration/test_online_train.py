"""Online mode for real: a Mooncake master, a producer process capturing with the tiny target, the trainer
consuming the stream. With one producer and a window of the whole corpus, the batches are the offline ones,
so the drafter trained online is bitwise the drafter trained from the store."""

import pytest

from draftsmith.core import storage
from draftsmith.drafters.training.torchrun import TorchrunError
from draftsmith.tasks.train import train

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _online(cfg, **online):
    hs = cfg.hidden_states
    return hs.model_copy(update={"mode": "online", "online": hs.online.model_copy(update=online)})


@pytest.mark.slow
def test_online_training_equals_offline_training_bitwise(tiny_cfg, tiny_run, tmp_path):
    c = tiny_cfg
    n = tiny_run["tokenize"].counts["samples"]
    hidden_cfg = _online(c, window_samples=n, segment_mb=64)
    m = train(c.train, c.drafter, c.target, hidden_cfg, tiny_run["tokenize"], None, seed=c.seed, out_uri=str(tmp_path))
    offline = tiny_run["train"]
    assert m.info["hidden_states"] == "online" and offline.info["hidden_states"] == "offline"
    assert m.counts["samples"] == c.train.epochs * n  # every sample, once per epoch
    assert m.counts["steps"] == offline.counts["steps"]
    got = {f.name: f.digest for f in m.files}
    want = {f.name: f.digest for f in offline.files}
    assert got["model.safetensors"] == want["model.safetensors"]
    timing = {"tokens_per_s", "mfu"}  # wall-clock figures; everything else is computed and must agree

    def curve(manifest):
        return [
            {k: v for k, v in r.items() if k not in timing} for r in storage.read_jsonl(manifest.path("metrics.jsonl"))
        ]

    assert curve(m) == curve(offline)


def test_a_producer_that_cannot_capture_fails_the_run_with_its_log(tiny_cfg, tiny_run, tmp_path):
    c = tiny_cfg
    hidden_cfg = _online(c, peer_timeout_s=60)
    bad_vllm = hidden_cfg.vllm.model_copy(update={"python": str(tmp_path / "no-such-venv" / "python")})
    hidden_cfg = hidden_cfg.model_copy(update={"engine": "vllm", "vllm": bad_vllm})
    with pytest.raises(TorchrunError) as err:
        train(c.train, c.drafter, c.target, hidden_cfg, tiny_run["tokenize"], None, seed=c.seed, out_uri=str(tmp_path))
    message = str(err.value)  # the training rank's StreamError, through torchrun
    assert "StreamError" in message and "producer 0 (exit 1" in message and "no-such-venv" in message, message
