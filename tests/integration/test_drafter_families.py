"""Drafter families through the real train and evaluate stages on the tiny target (shared upstream stages):
DFlash2, DSpark, and EAGLE-3.1 with MLA attention trained by anchored TTT.

Each family trains from the tiny run's hidden-state store, writes its serving checkpoint, loads it back and
decodes the held-out prompts speculatively; greedy verification must leave every output equal to plain
greedy decoding.
"""

import pytest

from draftsmith.core import storage
from draftsmith.core.config import PipelineConfig
from draftsmith.tasks.evaluate import evaluate
from draftsmith.tasks.train import train
from tests.support.models import FAMILY_CASES

pytestmark = pytest.mark.integration


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(FAMILY_CASES))
def test_block_drafter_trains_and_decodes_losslessly(kind, tiny_cfg, tiny_run):
    drafter, architecture, drafts = FAMILY_CASES[kind]
    cfg = PipelineConfig.model_validate(tiny_cfg.model_dump(mode="json") | {"drafter": drafter})
    run = storage.join(tiny_run["run_dir"], kind)
    ckpt = train(
        cfg.train,
        cfg.drafter,
        cfg.target,
        cfg.hidden_states,
        tiny_run["tokenize"],
        tiny_run["hidden_states"],
        seed=cfg.seed,
        out_uri=f"{run}/train",
    )
    config = storage.read_json(ckpt.path("config.json"))
    assert config["architectures"] == [architecture]
    assert config["draftsmith"]["taps"] == cfg.hidden_states.taps
    history = storage.read_jsonl(ckpt.path("metrics.jsonl"))
    assert len(history) == ckpt.counts["steps"] > 1
    slots = [k for k in history[0] if k.startswith("acc_")]
    assert len(slots) == drafts  # one accuracy per predicting slot (TTT depth for EAGLE-3)
    assert history[-1]["loss"] < history[0]["loss"]
    ev = evaluate(cfg.evaluate, cfg.drafter, cfg.target, tiny_run["select_prompts"], ckpt, out_uri=f"{run}/evaluate")
    results = storage.read_json(ev.path("results.json"))
    assert results["drafter"] == kind and results["draft_tokens_per_round"] == drafts
    assert results["mismatched_outputs"] == 0
    assert 1.0 <= results["acc_len"]["overall"] <= drafts + 1
