"""Prompts the target writes itself (`kind: target` sources), with the embedded SmolLM2 target."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from draftsmith.core.config import SelectConfig, load_recipe
from draftsmith.core.config.select import PromptSource, PromptWriting
from draftsmith.engines import hf
from draftsmith.engines.base import Completion
from draftsmith.tasks import prompt_writer
from draftsmith.tasks.select_prompts import read_prompts, select_prompts, select_prompts_key

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def smollm2():
    return load_recipe(ROOT / "deployments" / "recipes" / "smollm2-cpu-eagle3.yaml").target


def _source(**writing) -> PromptSource:
    return PromptSource(kind="target", writing=PromptWriting(**{"batch_size": 4, "max_new_tokens": 48, **writing}))


def test_pre_query_is_the_rendered_conversation_up_to_the_user_text(smollm2):
    _, tok = hf.load_target(smollm2)
    for system in (None, "You are terse."):
        head = prompt_writer.pre_query(tok, system)
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "Hi"}]
        assert tok.apply_chat_template(messages, tokenize=False) == head + "Hi<|im_end|>\n"
        assert head.endswith("<|im_start|>user\n")
        assert system is None or system in head


def test_a_template_that_drops_the_user_text_is_refused():
    class Mangling:
        def apply_chat_template(self, messages, **_):
            return "<user>" + messages[-1]["content"].upper()

    with pytest.raises(ValueError, match="select.sources: the target's chat template"):
        prompt_writer.pre_query(Mangling(), None)


def test_the_target_writes_varied_prompts_repeatably(smollm2):
    rows = [r for _, r in prompt_writer.written_rows(_source(), smollm2, count=4, seed=3)]
    again = [r for _, r in prompt_writer.written_rows(_source(), smollm2, count=4, seed=3)]
    other = [r for _, r in prompt_writer.written_rows(_source(), smollm2, count=4, seed=4)]
    assert len(rows) == 4 and rows == again and rows != other
    texts = [r["turns"][0] for r in rows]
    assert len(set(texts)) == len(texts) and all(t.strip() for t in texts)
    assert {r["category"] for r in rows} == {"self"}
    assert not any("<|im_" in t for t in texts)


def _scripted(monkeypatch, finished: list[bool]) -> list[int]:
    """Replaces sampling with completions that finish as `finished` says, in order; returns the batch sizes."""
    left, sizes = iter(enumerate(finished)), []

    def generate_texts(model, tok, texts, *, n, **_):
        sizes.append(n)
        out = []
        for i, done in itertools.islice(left, n):
            out.append(Completion(text=f"prompt {i}", num_tokens=5, finish_reason="stop" if done else "length"))
        return [out]

    monkeypatch.setattr(hf, "generate_texts", generate_texts)
    return sizes


def test_unfinished_prompts_are_drawn_again_and_numbered_by_draw(smollm2, monkeypatch):
    sizes = _scripted(monkeypatch, [True, False, True, False, False, True, True, True, True, True])
    state = torch.random.get_rng_state()
    rows = list(prompt_writer.written_rows(_source(), smollm2, count=4, seed=0))
    assert torch.equal(torch.random.get_rng_state(), state)  # seeding the draws leaves the caller's RNG alone
    assert [(n, r["id"], r["turns"]) for n, r in rows] == [
        (1, "target-1", ["prompt 0"]),
        (3, "target-3", ["prompt 2"]),
        (6, "target-6", ["prompt 5"]),
        (7, "target-7", ["prompt 6"]),
    ]
    assert sizes == [4, 4]  # the batch size, then what is still missing, twice over, up to it


def test_a_length_too_short_for_prompts_fails_naming_the_setting(smollm2, monkeypatch):
    _scripted(monkeypatch, [False] * 6 + [True] * 10)
    with pytest.raises(ValueError, match=r"finished 2 of 8 prompts within 48 tokens; raise writing.max_new_tokens"):
        list(prompt_writer.written_rows(_source(), smollm2, count=4, seed=0))


def test_a_system_message_is_kept_with_the_prompts_written_under_it(smollm2):
    rows = [r for _, r in prompt_writer.written_rows(_source(system="Ask about cooking."), smollm2, count=4, seed=0)]
    assert {r["system"] for r in rows if isinstance(r, dict)} == {"Ask about cooking."}


def _mixed(**writing) -> SelectConfig:
    return SelectConfig(
        sources=[PromptSource(kind="synthetic"), _source(**writing).model_copy(update={"max_rows": 12})],
        num_prompts=16,
        num_eval=4,
        mix={"math": 1.0, "coding": 1.0, "self": 2.0},
    )


@pytest.mark.slow
def test_the_select_stage_mixes_written_prompts_with_the_pool(smollm2, tmp_path):
    cfg = _mixed()
    m = select_prompts(cfg, smollm2, seed=0, out_uri=str(tmp_path / "s"))
    rows = read_prompts(m, "train") + read_prompts(m, "eval")
    own = [r for r in rows if r.category == "self"]
    assert m.counts["category.self"] == len(own) >= 6
    assert all(r.id.startswith("target-") for r in own)
    assert "| `target` | 12 |" in (tmp_path / "s" / "report.md").read_text()
    lost = sum(n for k, n in m.counts.items() if k.startswith(("dropped.", "rejected.")))
    assert m.counts["train"] + m.counts["eval"] + lost == m.counts["read"]
    # The written prompts depend on how they are sampled and on the target: both are in the key.
    base = select_prompts_key(cfg, smollm2, 0)
    assert select_prompts_key(_mixed(temperature=0.7), smollm2, 0) != base
    assert select_prompts_key(cfg, smollm2.model_copy(update={"name": "other"}), 0) != base
    assert select_prompts_key(cfg, smollm2, 1) != base


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ({"kind": "target", "path": "x.jsonl"}, r"select\.sources\[1\]\.path: a target source takes no path"),
        ({"kind": "jsonl", "path": "x.jsonl", "writing": {}}, r"select\.sources\[1\]\.writing: only kind 'target'"),
    ],
)
def test_misplaced_fields_name_their_dotted_path(source, message):
    with pytest.raises(ValidationError, match=message):
        SelectConfig(sources=[{"kind": "synthetic"}, source], num_prompts=8, num_eval=2)


def test_a_target_source_defaults_to_category_self():
    assert PromptSource(kind="target").category == "self"
    assert PromptSource(kind="target", category="chat").category == "chat"
    assert PromptSource(kind="jsonl", path="x.jsonl").category == "file"
