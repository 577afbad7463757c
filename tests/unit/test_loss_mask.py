"""Assistant-only loss masks by render boundary, on multi-turn ChatML conversations (SmolLM2's template)."""

import json

import numpy as np
import pytest
from transformers import AutoTokenizer

from draftsmith.core.target_setup import ensure_smollm2
from draftsmith.tasks.tokenization import assistant_spans, encode
from tests.support.runs import encoded

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
    enc = encoded(tok, CONVERSATION, max_length=4096, last_turn_only=False)
    assert _masked_runs(tok, enc) == ["4.<|im_end|>\n", "Eight, since 4 x 2 = 8.<|im_end|>\n"]
    # The prompt side (system, user turns, the assistant headers) carries no loss.
    text = tok.decode(enc.input_ids[enc.loss_mask == 0])
    assert "<|im_start|>assistant\n" in text and "And doubled?" in text and "Eight" not in text


def test_last_turn_only(tok):
    enc = encoded(tok, CONVERSATION, max_length=4096, last_turn_only=True)
    assert _masked_runs(tok, enc) == ["Eight, since 4 x 2 = 8.<|im_end|>\n"]


def test_truncation_keeps_the_prefix_and_flags_it(tok):
    full = encoded(tok, CONVERSATION, max_length=4096, last_turn_only=False)
    cut = encoded(tok, CONVERSATION, max_length=len(full.input_ids) - 5, last_turn_only=False)
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


def test_truncation_policies(tok):
    full = encoded(tok, CONVERSATION, max_length=4096, last_turn_only=False)
    limit = len(full.input_ids) - 5
    assert encode(tok, CONVERSATION, max_length=limit, last_turn_only=False, truncation="drop") is None
    kept = encoded(tok, CONVERSATION, max_length=limit, last_turn_only=False, truncation="keep_last_turns")
    # The first exchange is gone, the system prompt and the whole last turn stay.
    assert kept.truncated and len(kept.input_ids) <= limit
    text = tok.decode(kept.input_ids)
    assert "You are terse." in text and "What is 2 + 2?" not in text and text.endswith("= 8.<|im_end|>\n")
    assert _masked_runs(tok, kept) == ["Eight, since 4 x 2 = 8.<|im_end|>\n"]
    # When even the last turn alone does not fit, the sample is dropped rather than cut mid-turn.
    assert encode(tok, CONVERSATION, max_length=10, last_turn_only=False, truncation="keep_last_turns") is None


def _worker(tmp_tok_path, **opts):
    from draftsmith.tasks.token_encode import Options, _init_worker, _process_lines

    _init_worker(tmp_tok_path, "chat_template", Options(**({"max_length": 4096} | opts)))
    return _process_lines


def _line(obj) -> bytes:
    return json.dumps(obj).encode()


def test_min_loss_tokens_and_thinking_in_the_worker_path():
    process = _worker(str(ensure_smollm2()), min_loss_tokens=5, thinking=False)
    short = {"id": "a", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}
    long = {"id": "b", "messages": CONVERSATION}
    out = process("s", [(1, _line(short)), (2, _line(long))])
    assert out[0] == ("drop", "min_loss_tokens") and out[1][0] == "ok" and out[1][1] == "b"
    # ChatML ignores reasoning either way; with thinking off it is stripped before the template sees it.
    reasoning = {"id": "c", "messages": [*CONVERSATION[:-1], {**CONVERSATION[-1], "reasoning_content": "x"}]}
    assert process("s", [(1, _line(reasoning))])[0][3] == out[1][3]


@pytest.mark.parametrize(
    ("raw", "reason", "detail"),
    [
        (b"\xff\xfe{}", "invalid_utf8", "not UTF-8"),
        (b'{"id": "x", "messages": [', "malformed_json", "invalid JSON"),
        (b"[1, 2]", "malformed_json", "JSON object"),
        (b'{"id": "x"}', "missing_messages", "neither"),
        (b'{"id": "x", "messages": [{"content": "hi"}]}', "missing_role", "messages[0]: has no role"),
        (b'{"id": "x", "messages": [{"role": "bot", "content": "hi"}]}', "unknown_role", "messages[0].role"),
        (b'{"id": "x", "messages": [{"role": "user", "content": 3}]}', "non_string_content", "messages[0].content"),
        (
            b'{"id": "x", "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": " "}]}',
            "empty_assistant_turn",
            "messages[1]",
        ),
        (b'{"id": "x", "messages": [{"role": "user", "content": "a"}]}', "no_final_assistant_turn", "'user' turn"),
        (b'{"id": "x", "input_ids": [1, 2], "loss_mask": [1]}', "bad_pretokenized", "equal non-zero length"),
        (b'{"id": "x", "input_ids": [1, 99999], "loss_mask": [0, 1]}', "bad_pretokenized", "99999 outside"),
        (b'{"id": "x", "input_ids": [1, 2], "loss_mask": [0, 2]}', "bad_pretokenized", "0 or 1"),
    ],
)
def test_bad_rows_are_rejected_with_a_reason(raw, reason, detail):
    from draftsmith.tasks.token_rows import Rejected, parse_line

    got = parse_line(raw, fallback_id="f:1", thinking=False, vocab_size=49152)
    assert isinstance(got, Rejected) and got.reason == reason and detail in got.detail


def test_pretokenized_rows_pass_through_unchanged():
    process = _worker(str(ensure_smollm2()), max_length=3)
    ok = process("s", [(1, _line({"id": "p", "category": "c", "input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}))])[0]
    assert ok[:3] == ("ok", "p", "c")
    assert np.frombuffer(ok[3], np.int32).tolist() == [5, 6, 7] and np.frombuffer(ok[4], np.uint8).tolist() == [0, 1, 1]
    cut = process("s", [(1, _line({"input_ids": [5, 6, 7, 8], "loss_mask": [0, 1, 1, 1]}))])[0]
    assert cut[1] == "s:1" and np.frombuffer(cut[3], np.int32).tolist() == [5, 6, 7] and cut[5] is True


def test_a_template_refusing_the_shortened_conversation_rejects_that_row_only(tok):
    from draftsmith.tasks.renderers import as_renderer
    from draftsmith.tasks.token_encode import ConversationRow, Options, encode_conversations
    from draftsmith.tasks.token_rows import Rejected

    class RefusesShortened:
        """The tokenizer's template, raising (as a strict template may) once the first exchange is cut."""

        name = "strict"

        def __init__(self) -> None:
            self.inner = as_renderer(tok)

        def render_many(self, convs, *, add_generation_prompt):
            if any(m["content"] == "And doubled?" and len(msgs) < 4 for msgs, _ in convs for m in msgs):
                raise ValueError("conversation must start with the first exchange")
            return self.inner.render_many(convs, add_generation_prompt=add_generation_prompt)

        def template_sha256(self):
            return self.inner.template_sha256()

    full = encoded(tok, CONVERSATION, max_length=4096, last_turn_only=False)
    rows = [ConversationRow("long", "x", CONVERSATION, None), ConversationRow("short", "x", CONVERSATION[:3], None)]
    opts = Options(len(full.input_ids) - 5, "keep_last_turns", False, 0)
    long_row, short_row = encode_conversations(tok, RefusesShortened(), rows, opts)
    assert isinstance(long_row, Rejected) and long_row.reason == "render_failed", long_row
    assert "keeping the last turns: ValueError: conversation must start" in long_row.detail
    assert not isinstance(short_row, Rejected | str) and not short_row.truncated
