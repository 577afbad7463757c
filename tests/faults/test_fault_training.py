"""Training that diverges and never recovers fails the stage, naming `train.lr` and the steps, instead of
exporting a drafter that only looks trained."""

import pytest

from draftsmith.tasks.train import train

pytestmark = pytest.mark.integration


def test_a_huge_learning_rate_fails_the_train_stage(tiny_cfg, tiny_run, tmp_path):
    c = tiny_cfg
    # Short of train.max_consecutive_skips (10) in the tiny run's 6 steps: the end of training must notice.
    cfg = c.train.model_copy(update={"lr": 1e30})
    with pytest.raises(Exception, match=r"train\.lr \(now 1e\+30\)") as err:
        train(
            cfg,
            c.drafter,
            c.target,
            c.hidden_states,
            tiny_run["tokenize"],
            tiny_run["hidden_states"],
            seed=c.seed,
            out_uri=str(tmp_path / "train"),
        )
    assert "never recovered" in str(err.value) and "steps " in str(err.value)
    assert not (tmp_path / "train" / "manifest.json").exists()
    assert not (tmp_path / "train" / "model.safetensors").exists()
