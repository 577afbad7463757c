"""Assistant-only loss masks by render boundary, on multi-turn ChatML conversations (SmolLM2's template)."""

import numpy as np
import pytest
from transformers import AutoTokenizer

from draftsmith.target_setup import ensure_smollm2
from tasks.tokenization import assistant_spans, encode

pytestmark = pytest.mark.unit

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And doubled?"},
    {"role": "assistant", "content": "Eight, since 4 x 2 = 8."},
]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(ensure_smollm2())


def _masked_runs(tok, enc) -> list[str]:
    """Decoded text of each contiguous run of loss tokens."""
    runs, current = [], []
    for token, m in zip(enc.input_ids.tolist(), enc.loss_mask.tolist(), strict=True):
        if m:
            current.append(token)
        elif current:
            runs.append(tok.decode(current))
            current = []
    if current:
        runs.append(tok.decode(current))
    return runs


def test_every_assistant_turn_and_only_those(tok):
    enc = encode(tok, CONVERSATION, max_length=4096, last_turn_only=False)
    assert _masked_runs(tok, enc) == ["4.<|im_end|>\n", "Eight, since 4 x 2 = 8.<|im_end|>\n"]
    # The prompt side (system, user turns, the assistant headers) carries no loss.
    text = tok.decode(enc.input_ids[enc.loss_mask == 0])
    assert "<|im_start|>assistant\n" in text and "And doubled?" in text and "Eight" not in text


def test_last_turn_only(tok):
    enc = encode(tok, CONVERSATION, max_length=4096, last_turn_only=True)
    assert _masked_runs(tok, enc) == ["Eight, since 4 x 2 = 8.<|im_end|>\n"]


def test_truncation_keeps_the_prefix_and_flags_it(tok):
    full = encode(tok, CONVERSATION, max_length=4096, last_turn_only=False)
    cut = encode(tok, CONVERSATION, max_length=len(full.input_ids) - 5, last_turn_only=False)
    assert cut.truncated and not full.truncated
    assert np.array_equal(cut.input_ids, full.input_ids[:-5]) and np.array_equal(cut.loss_mask, full.loss_mask[:-5])


def test_spans_are_character_boundaries_of_the_render(tok):
    text, spans = assistant_spans(tok, CONVERSATION, last_turn_only=False)
    assert [text[a:b] for a, b in spans] == ["4.<|im_end|>\n", "Eight, since 4 x 2 = 8.<|im_end|>\n"]


def test_template_that_rewrites_history_is_refused(tok):
    class Rewriting:
        """A template whose render of earlier turns changes as the conversation grows."""

        def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=False):
            body = "".join(f"[{m['role']}:{len(messages)}]{m['content']}" for m in messages)
            return body + ("[assistant]" if add_generation_prompt else "")

    with pytest.raises(ValueError, match="not prefix-stable"):
        assistant_spans(Rewriting(), CONVERSATION, last_turn_only=False)
