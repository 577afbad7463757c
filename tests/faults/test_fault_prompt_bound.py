"""Without `select.max_prompt_tokens`, the target's context bounds prompt length: a 200,000-character prompt
is rejected by reason, with its id, instead of reaching the target."""

import json
import random

import pytest

from draftsmith.core import storage
from draftsmith.core.config import SelectConfig
from draftsmith.tasks.select_prompts import read_prompts, select_prompts

pytestmark = pytest.mark.integration
LONG_ID = "huge-0"


def _corpus(tmp_path) -> str:
    rng = random.Random(0)
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < 200_000:
        words.append(f"w{rng.randrange(10**6)}")
    rows = [{"id": LONG_ID, "prompt": " ".join(words)[:200_000]}]
    rows += [{"id": f"short-{i}", "prompt": f"Question {i}: what is {i} times {i * 7 + 3}?"} for i in range(30)]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_a_prompt_longer_than_the_targets_context_is_rejected(tiny_cfg, tmp_path):
    cfg = SelectConfig(source="jsonl", path=_corpus(tmp_path), num_prompts=40, num_eval=4, near_dedupe=False)
    assert cfg.max_prompt_tokens is None
    m = select_prompts(cfg, tiny_cfg.target, seed=0, out_uri=str(tmp_path / "s"))
    kept = {r.id for r in read_prompts(m, "train") + read_prompts(m, "eval")}
    assert LONG_ID not in kept and len(kept) == 30
    rejected = [r for r in storage.read_jsonl(m.path("rejected.jsonl")) if r["id"] == LONG_ID]
    assert len(rejected) == 1 and rejected[0]["reason"] == "exceeds_context"
    assert "context (2048)" in rejected[0]["detail"], rejected[0]["detail"]  # the tiny target's
    assert m.counts["rejected.exceeds_context"] == 1
