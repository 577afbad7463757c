"""Fuzzed prompt rows and conversations through the real readers and tokenizer (recipes:
`test_fault_fuzz_recipes.py`).

Every JSONL row is either accepted as written or rejected with a one-line reason at its line number, and an
accepted conversation tokenizes to the tiny target's rendering with loss on assistant text only. Examples are
derandomized, so a run is the same everywhere.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from draftsmith.core.config.select import PromptSource
from draftsmith.core.rejects import Rejects
from draftsmith.core.target_setup import resolve_target
from draftsmith.tasks import prompt_filters, token_encode, token_rows
from draftsmith.tasks.prompt_sources import load_sources
from tests.support.fuzz import FUZZ

pytestmark = pytest.mark.unit

VOCAB = 49152  # tiny-cpu.yaml's target.vocab_size
REASON = re.compile(r"[a-z][a-z0-9_]*")

# ---- text and JSON --------------------------------------------------------------------------------------

_ODD = ["\x00", "\x01", "\x07", "\x1b[0m", "\t", "\r", "\n", "\r\n", "\x0b", "\x1c", "\x85", "\u2028", "\u200b",
        "\ufeff", " ", "\u3000", "é", "ß", "日本語", "🙂", "\U0010fffd", "<|im_end|>", "<|im_start|>assistant\n",
        "<|endoftext|>", "{{ messages }}", "{% raw %}", "\\u0000", '"', "\\", "Ġ"]  # fmt: skip
_SURROGATES: tuple[Literal["Cs"]] = ("Cs",)
_CHARS = st.characters(exclude_categories=_SURROGATES)  # JSON text holds no lone surrogates; escapes are fuzzed apart
TEXT = st.one_of(
    st.text(_CHARS, max_size=24),
    st.lists(st.sampled_from(_ODD) | st.text(_CHARS, max_size=4), max_size=8).map("".join),
    st.integers(300, 3000).map(lambda n: "word " * n),
)
WORDY = st.tuples(TEXT, st.sampled_from("aZ9ж字?"), TEXT).map("".join)  # never blank
JSON = st.recursive(
    # Finite floats: Python writes NaN as a bare `NaN`, which is not JSON; the "nan" line above fuzzes that.
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(_CHARS),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(_CHARS, max_size=6), kids, max_size=3),
    max_leaves=6,
)


@st.composite
def _raw_line(draw, row: dict) -> bytes:
    """`row` as a JSONL line, or that line broken: cut, odd bytes, a BOM, deep nesting, a huge number..."""
    line = json.dumps(row, ensure_ascii=draw(st.booleans())).encode()
    kind = draw(st.sampled_from(["cut", "bytes", "bom", "scalar", "deep", "bigint", "surrogate", "nan"]))
    at = draw(st.integers(0, len(line)))
    if kind == "cut":
        return line[:at] or b"{"
    if kind == "bytes":
        junk = draw(st.binary(min_size=1, max_size=4).filter(lambda b: b"\n" not in b))
        return line[:at] + junk + line[at:]
    if kind == "bom":
        return b"\xef\xbb\xbf" + line
    if kind == "scalar":
        return draw(st.sampled_from([b"[]", b"1", b"null", b'"prompt"', b"true", b"[{}]"]))
    if kind == "deep":
        depth = draw(st.integers(900, 3000))
        return b'{"prompt": "x", "id": ' + b"[" * depth + b"]" * depth + b"}"
    if kind == "bigint":
        return b'{"prompt": "x", "id": ' + b"7" * draw(st.integers(20, 6000)) + b"}"
    if kind == "surrogate":  # a lone \uD800-\uDFFF escape inside the first string value
        escape = draw(st.sampled_from([b"\\ud800", b"\\udfff", b"\\uDC00x", b"\\ud83d"]))
        return line.replace(b'": "', b'": "' + escape, 1) if b'": "' in line else line
    return line.replace(b'": "', b'": NaN, "x": "', 1)


def _mutate(draw, row: dict, shape: str) -> dict:
    """`row` with one field replaced, removed or broken."""
    row = json.loads(json.dumps(row))
    keys = [*row, shape, "id", "category", "system", "tools", "messages", "prompt"]
    kind = draw(st.sampled_from(["replace", "delete", "message", "message-field"]))
    items = row.get(shape) if isinstance(row.get(shape), list) else None
    if kind.startswith("message") and items:
        i = draw(st.integers(0, len(items) - 1))
        if kind == "message" or not isinstance(items[i], dict):
            items[i] = draw(JSON)
        else:
            items[i][draw(st.sampled_from(["role", "content", "from", "value", "tool_calls", "type"]))] = draw(JSON)
    elif kind == "delete" and row:
        row.pop(draw(st.sampled_from(sorted(row))))
    else:
        row[draw(st.sampled_from(keys))] = draw(JSON | TEXT)
    return row


# ---- prompt sources (select) ----------------------------------------------------------------------------


@st.composite
def prompt_row(draw) -> tuple[dict, dict | None]:
    """A source row and what it must become, or None where it may instead be rejected."""
    shape = draw(st.sampled_from(["prompt", "turns", "messages", "conversations"]))
    users = draw(st.lists(WORDY, min_size=1, max_size=3))
    systems: list[str] = []
    row: dict[str, Any]
    if shape == "prompt":
        users, row = users[:1], {"prompt": users[0]}
    elif shape == "turns":
        row = {"turns": users}
    else:
        sharegpt = shape == "conversations"
        systems = draw(st.lists(TEXT, max_size=2))
        msgs = [_prompt_message(draw, "system", s, sharegpt)[0] for s in systems]
        for i, u in enumerate(users):
            msg, users[i] = _prompt_message(draw, "user", u, sharegpt)
            msgs.append(msg)
            if draw(st.booleans()):
                msgs.append(_prompt_message(draw, "assistant", draw(WORDY), sharegpt)[0])
            if not sharegpt and draw(st.booleans()):
                msgs.append({"role": "tool", "tool_call_id": "c1", "content": draw(TEXT)})
        row = {shape: msgs}
    want: dict[str, Any] = {
        "id": None,
        "category": None,
        "system": "\n\n".join(s for s in systems if s.strip()) or None,
    }
    want |= {"turns": users, "tools": None}
    if not want["system"] and draw(st.booleans()):
        row["system"] = draw(TEXT)
        want["system"] = row["system"] if row["system"].strip() else None
    ident = draw(st.none() | st.sampled_from(["a", "b", "1", "ид", " x "]) | st.integers(0, 2))
    if ident is not None:
        row["id"], want["id"] = ident, str(ident)
    if draw(st.booleans()):
        row["category"] = want["category"] = draw(WORDY)
    if draw(st.booleans()):
        tools = [{"type": "function", "function": {"name": draw(WORDY)}} for _ in range(draw(st.integers(0, 2)))]
        row["tools"], want["tools"] = (json.dumps(tools) if draw(st.booleans()) else tools), tools or None
    if draw(st.booleans()):
        row["meta"] = draw(JSON)  # keys no shape reads are left alone
    if draw(st.integers(0, 9)) < 4:
        return (_mutate(draw, row, shape), None) if draw(st.booleans()) else (draw(_raw_line(row)), None)
    return row, want


def _prompt_message(draw, role: str, content: str, sharegpt: bool) -> tuple[dict, str]:
    """A message in the row's format, and the text it stands for."""
    if sharegpt:
        names = {"system": ["system"], "user": ["human", "user", " Human "], "assistant": ["gpt", "chatgpt", "bard"]}
        return {"from": draw(st.sampled_from(names[role])), "value": content}, content
    if role == "system":
        return {"role": draw(st.sampled_from(["system", "developer"])), "content": content}, content
    if role == "user" and draw(st.booleans()):  # OpenAI content parts, joined with a newline
        cut = draw(st.integers(0, len(content)))
        parts = [content[:cut], content[cut:]]
        return {"role": "user", "content": [{"type": "text", "text": p} for p in parts]}, "\n".join(parts)
    return {"role": role, "content": content}, content


def _one_line(text: str, limit: int = 400) -> bool:
    return bool(text) and len(text) <= limit and len(text.splitlines()) == 1 and text.isprintable()


def _strings(value) -> set[str]:
    """Every string in a parsed row, plus the joined texts of content-part lists."""
    if isinstance(value, str):
        return {value}
    if isinstance(value, dict):
        return set().union(*map(_strings, value.values()), map(str, value))
    if not isinstance(value, list):
        return {str(value)}
    out = set().union(*map(_strings, value))
    if value and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in value):
        out.add("\n".join(p["text"] for p in value))
    return out


@pytest.fixture(scope="module")
def light_tok():
    folder = resolve_target("embedded:tiny-llama", tokenizer_only=True)
    tok = token_encode.load_light_tokenizer(str(folder))
    assert tok is not None, "the tiny target's tokenizer is a generic tokenizers folder"
    return tok


@FUZZ
@given(rows=st.lists(st.tuples(prompt_row(), st.sampled_from([None, None, b"", b"  \t"])), min_size=1, max_size=6))
@example(rows=[((b'{"prompt": "\\ud800 hi"}', None), None)])  # json.loads gave a lone surrogate: train.jsonl failed
@example(rows=[((b'{"prompt": "x", "id": ' + b"[" * 3000 + b"]" * 3000 + b"}", None), None)])  # RecursionError
@example(rows=[((b'{"prompt": "x", "id": ' + b"7" * 5000 + b"}", None), None)])  # int digit limit: ValueError
@example(rows=[((b'\x80{"prompt": "a"}', None), None)])  # not UTF-8 before the row: rejected by its line
@example(rows=[(({"prompt": "a", "category": " " * 999}, None), None)])  # a reason of 1000 characters
@example(rows=[(({"prompt": "a", "id": "word " * 300}, None), None)] * 2)  # ... and with a long repeated id
def test_prompt_rows_are_accepted_as_written_or_rejected_by_line(light_tok, rows):
    lines, wants = [], []
    for (row, want), blank in rows:
        lines.append(row if isinstance(row, bytes) else _row_bytes(row))
        wants.append(want)
        if blank is not None:  # skipped, but counted: line numbers stay the file's
            lines.append(blank)
            wants.append(None)
    with tempfile.TemporaryDirectory(prefix="draftsmith-fuzz-") as folder:
        path = os.path.join(folder, "rows.jsonl")
        Path(path).write_bytes(b"\n".join(lines) + b"\n")
        _check_prompt_file(path, lines, wants, light_tok)


def _check_prompt_file(path: str, lines: list[bytes], wants: list, tok) -> None:
    rejects = Rejects("select_prompts")
    loaded = load_sources([PromptSource(kind="jsonl", path=path)], synthetic_rows=0, mix=None, seed=0, rejects=rejects)
    nonblank = [n for n, line in enumerate(lines, 1) if line.strip()]
    by_line = {r["line"]: r for r in rejects.rows}
    assert loaded.read == len(nonblank) and len(by_line) == len(rejects.rows) and set(by_line) <= set(nonblank)
    for r in rejects.rows:
        assert REASON.fullmatch(r["reason"]) and _one_line(r["detail"]), r
    accepted = [n for n in nonblank if n not in by_line]
    assert len(accepted) == len(loaded.records)
    first_line = {}
    for n, record in zip(accepted, loaded.records, strict=True):
        first_line[record.id] = n
        want = wants[n - 1]
        if want is None:  # whatever was accepted is text the row holds, not something made up
            held = _strings(json.loads(lines[n - 1]))
            assert all(turn in held for turn in record.turns), (lines[n - 1], record)
            continue
        got = record.model_dump()
        assert got == want | {"id": want["id"] or f"rows.jsonl-{n}", "category": want["category"] or "file"}
    for n in nonblank:
        if wants[n - 1] is not None and n in by_line:  # a sound row is only ever refused for a repeated id
            r = by_line[n]
            assert r["reason"] == "duplicate_id" and first_line[r["id"]] < n, r
    _filters_and_writers(loaded.records, rejects, tok)


def _row_bytes(row: dict) -> bytes:
    # Both spellings of non-ASCII text: raw UTF-8, and \u escapes (surrogate pairs for astral characters).
    return json.dumps(row, ensure_ascii=len(json.dumps(row)) % 2 == 0).encode()


def _filters_and_writers(records: list, rejects: Rejects, tok) -> None:
    """The selection filters count every record they drop, and what is kept or rejected can be written."""

    def count(texts: list[str]) -> list[int]:
        return [len(ids) for ids in tok(texts)["input_ids"]]

    kept, exact = prompt_filters.exact_dedupe(records)
    lengths = prompt_filters.token_lengths(kept, count)
    kept, short, long = prompt_filters.length_filter(kept, count, min_tokens=2, max_tokens=600, lengths=lengths)
    kept, near = prompt_filters.near_dedupe(kept, threshold=0.7, num_perm=32, shingle_size=3)
    assert len(kept) + exact + short + long + near == len(records)
    assert all(any(k is r for r in records) for k in kept)
    for record in kept:
        record.model_dump_json().encode("utf-8")  # train.jsonl is UTF-8
    with tempfile.TemporaryDirectory() as folder:
        rejects.write(folder)


# ---- conversations (tokenize) ---------------------------------------------------------------------------

DEFAULT_SYSTEM = b"<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


def _chatml(messages: list[dict], dropped: bytes) -> tuple[bytes, list[tuple[int, int, int]]]:
    """The tiny target's rendering (SmolLM2's ChatML) as its tokens spell it, and, per assistant message, the
    byte offsets where its content starts, where its leading whitespace ends and where its turn ends.

    `dropped`: bytes with no symbol in the byte-level vocabulary, which the tokenizer leaves out (the target
    sees the same at inference, so they are part of its view of the text, not something to train apart).
    """

    def spelt(text: str) -> bytes:
        return text.encode().translate(None, dropped)

    out = b"" if messages[0]["role"] == "system" else DEFAULT_SYSTEM
    turns = []
    for m in messages:
        out += spelt(f"<|im_start|>{m['role']}\n")
        space = re.match(r"\s*", m["content"])
        assert space is not None  # `\s*` matches every string
        start, lead = len(out), len(spelt(space.group()))
        out += spelt(m["content"]) + b"<|im_end|>\n"
        if m["role"] == "assistant":
            turns.append((start, start + lead, len(out)))
    return out, turns


def _token_bytes(tok) -> tuple[list[bytes], bytes]:
    """Each token id's bytes, and the bytes that no symbol of the vocabulary stands for (GPT-2's byte-level
    alphabet: printable bytes stand for themselves, the others for the characters from U+0100 on)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    order = printable + [b for b in range(256) if b not in printable]
    chars = printable + [256 + i for i in range(256 - len(printable))]
    byte_of = {chr(c): b for c, b in zip(chars, order, strict=True)}
    backend = tok._tokenizer
    added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
    table = [
        added[i].encode() if i in added else bytes(byte_of[c] for c in backend.id_to_token(i)) for i in range(VOCAB)
    ]
    vocab = backend.get_vocab()
    return table, bytes(sorted(b for c, b in byte_of.items() if c not in vocab))


def _mask_problem(worker, ids, mask, messages, last_turn_only) -> str | None:
    """Why `ids`/`mask` are not `messages` rendered with loss on assistant turns only, or None."""
    text, turns = _chatml(messages, worker.dropped)
    pieces = [worker.table[i] for i in ids]
    if b"".join(pieces) != text:
        return "the tokens do not decode to the rendered conversation"
    ends = np.cumsum([len(p) for p in pieces])
    runs, start = [], None
    for k, on in enumerate([*mask, 0]):
        if on and start is None:
            start = int(ends[k - 1]) if k else 0
        if not on and start is not None:
            runs.append((start, int(ends[k - 1])))
            start = None
    trained = turns[-1:] if last_turn_only else turns
    if len(runs) != len(trained):
        return f"{len(runs)} masked runs for {len(trained)} trained assistant turns"
    for (lo, hi), (content, lead, end) in zip(runs, trained, strict=True):
        # Loss starts on the first token starting in the turn: whitespace after the header may share one.
        if not (content <= lo <= lead and hi == end):
            return f"loss on bytes {lo}..{hi}, assistant turn at {content}..{end}: {text[lo:hi]!r}"
    return None


@st.composite
def conversation_line(draw) -> tuple[bytes, str | None]:
    """A tokenize input line and `conv`/`pre` where it must be accepted, None where it may be rejected."""
    kind: str | None
    row: dict[str, Any]
    if draw(st.integers(0, 9)) == 0:
        n = draw(st.integers(1, 40))
        row = {"input_ids": draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n))}
        row["loss_mask"] = draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
        kind = "pre"
    else:
        roles = draw(st.lists(st.sampled_from(["system", "user", "user", "assistant", "tool"]), max_size=5))
        row = {"messages": [_conv_message(draw, role) for role in [*roles, "assistant"]]}
        # An opening assistant turn is placed only where the template renders nothing before it; this one
        # renders a default system prompt there, so such a row may be rejected.
        kind = "conv" if roles[:1] not in ([], ["assistant"]) else None
    if draw(st.booleans()):
        row["id"] = draw(WORDY | st.just(" "))
    if draw(st.booleans()):
        row["category"] = draw(TEXT)
    if draw(st.booleans()):
        row["tools"] = draw(st.lists(st.dictionaries(st.text(max_size=5), JSON, max_size=2), max_size=2))
    if draw(st.integers(0, 9)) < 4:
        if draw(st.booleans()):
            return draw(_raw_line(row)), None
        return json.dumps(_mutate(draw, row, "messages" if kind == "conv" else "input_ids")).encode(), None
    return json.dumps(row, ensure_ascii=draw(st.booleans())).encode(), kind


def _conv_message(draw, role: str) -> dict:
    if role != "assistant":
        msg = {"role": role, "content": draw(TEXT)}
        return msg | ({"tool_call_id": "c1"} if role == "tool" else {}) | draw(st.just({}) | st.just({"weight": 0}))
    msg = {"role": role, "content": draw(WORDY)}
    if draw(st.booleans()):
        msg["reasoning_content"] = draw(TEXT)
    if draw(st.integers(0, 3)) == 0:
        call = {"id": "c1", "type": "function", "function": {"name": draw(WORDY), "arguments": draw(TEXT)}}
        msg |= {"tool_calls": [call], "content": draw(st.sampled_from([None, "", msg["content"]]))}
    return msg


OPTIONS = st.builds(
    token_encode.Options,
    max_length=st.sampled_from([16, 48, 4096]),
    truncation=st.sampled_from(["truncate", "drop", "keep_last_turns"]),
    last_turn_only=st.booleans(),
    min_loss_tokens=st.integers(0, 3),
    vocab_size=st.just(VOCAB),
)


@pytest.fixture(scope="module")
def worker():
    """The tokenize stage's in-process worker (`num_workers: 0`) on the tiny target, and its token bytes."""
    folder = str(resolve_target("embedded:tiny-llama", tokenizer_only=True))
    token_encode._init_worker(folder, "chat_template", token_encode.Options(max_length=4096, vocab_size=VOCAB))
    state = token_encode._worker()
    text, _ = _chatml([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], b"")
    rendered = state["renderer"].render_many([([{"role": "user", "content": "hi"}, {"role": "assistant",
                                              "content": "yo"}], None)], add_generation_prompt=False)  # fmt: skip
    assert rendered == [text.decode()], "the oracle below assumes the tiny target renders SmolLM2's ChatML"
    yield _Worker(state["tok"], state["renderer"], *_token_bytes(state["tok"]))
    token_encode._WORKER.clear()


class _Worker:
    def __init__(self, tok: Any, renderer: Any, table: list[bytes], dropped: bytes) -> None:
        self.tok, self.renderer, self.table, self.dropped = tok, renderer, table, dropped

    def __repr__(self) -> str:  # shown in every failing example
        return "<tokenize worker on the tiny target>"


@FUZZ
@given(lines=st.lists(conversation_line(), min_size=1, max_size=5), opts=OPTIONS)
@example(  # repr() of a rejected field recursed through orjson's 1024 levels and raised
    lines=[(b'{"id": ' + b"[" * 1000 + b"]" * 1000 + b', "messages": []}', None)],
    opts=token_encode.Options(max_length=48, vocab_size=VOCAB),
)
@example(  # the fast path placed an opening assistant turn the reference path refuses (a default system prompt)
    lines=[(b'{"messages": [{"role": "assistant", "content": "a"}]}', None)],
    opts=token_encode.Options(max_length=48, vocab_size=VOCAB),
)
def test_conversations_tokenize_to_their_rendering_or_are_rejected_by_line(worker, lines, opts):
    token_encode._WORKER["opts"] = opts  # what `_init_worker` stores; the tokenizer and renderer do not change
    numbered = [(n, raw) for n, (raw, _) in enumerate(lines, 1)]
    results = token_encode._process_lines("fuzz.jsonl", numbered)
    assert len(results) == len(lines)
    for (n, raw), (_, want), res in zip(numbered, lines, results, strict=True):
        if res[0] == "reject":
            _, line, _, reason, detail, _ = res
            assert line == n and REASON.fullmatch(reason) and _one_line(detail, 500), res
            assert want is None, f"a sound row was rejected: {res[3:5]}"
            continue
        row = token_rows.parse_line(raw, fallback_id=f"fuzz.jsonl:{n}", thinking=False, vocab_size=VOCAB)
        if res[0] == "drop":
            assert res[1] == _reference_drop(worker, row, opts), res
            continue
        _, _, _, ids_bytes, mask_bytes, truncated = res
        ids, mask = np.frombuffer(ids_bytes, np.int32), np.frombuffer(mask_bytes, np.uint8)
        assert len(ids) == len(mask) <= opts.max_length and ids.min() >= 0 and ids.max() < VOCAB
        assert set(mask.tolist()) <= {0, 1} and mask.sum() >= opts.min_loss_tokens
        if isinstance(row, token_rows.PretokenizedRow):
            assert ids.tolist() == row.input_ids[: opts.max_length].tolist()
            assert mask.tolist() == row.loss_mask[: opts.max_length].tolist()
            continue
        _check_conversation(worker, raw, row, (ids, mask, truncated), opts)


def _reference_drop(worker, row, opts) -> str | None:
    """The reference path's verdict on the whole row: a drop reason, or None when it is kept."""
    if isinstance(row, token_rows.PretokenizedRow):
        if len(row.input_ids) > opts.max_length and opts.truncation != "truncate":
            return "too_long"
        return "min_loss_tokens" if int(row.loss_mask[: opts.max_length].sum()) < opts.min_loss_tokens else None
    [enc] = token_encode.encode_conversations(worker.tok, worker.renderer, [row], opts, fast=False)
    if isinstance(enc, str):
        return enc
    assert isinstance(enc, token_encode.Encoded), enc
    return "min_loss_tokens" if int(enc.loss_mask.sum()) < opts.min_loss_tokens else None


def _check_conversation(worker, raw: bytes, row, got: tuple, opts) -> None:
    ids, mask, truncated = got
    tok, renderer = worker.tok, worker.renderer
    source = json.loads(raw)["messages"]
    for kept, given_msg in zip(row.messages, source, strict=True):  # roles and text exactly as written
        assert kept["role"] == given_msg["role"] and kept["content"] == (given_msg.get("content") or "")
    [ref] = token_encode.encode_conversations(tok, renderer, [row], opts, fast=False)
    assert isinstance(ref, token_encode.Encoded), f"the reference path refuses what the fast path kept: {ref}"
    assert ids.tolist() == ref.input_ids.tolist() and mask.tolist() == ref.loss_mask.tolist(), "fast != reference"
    whole = token_encode.Options(10**9, last_turn_only=opts.last_turn_only, vocab_size=VOCAB)
    [full] = token_encode.encode_conversations(tok, renderer, [row], whole)
    assert isinstance(full, token_encode.Encoded), full
    assert truncated == (len(full.input_ids) > opts.max_length)
    problem = _mask_problem(worker, full.input_ids, full.loss_mask, row.messages, opts.last_turn_only)
    assert problem is None, problem
    if truncated and opts.truncation == "truncate":
        assert ids.tolist() == full.input_ids[: opts.max_length].tolist()
        assert mask.tolist() == full.loss_mask[: opts.max_length].tolist()
    elif truncated:  # keep_last_turns: the system prompt and the conversation from some later user turn on
        users = [i for i, m in enumerate(row.messages) if m["role"] == "user"]
        cuts = [row.messages[: users[0]] + row.messages[u:] for u in users[1:]]
        assert any(_mask_problem(worker, ids, mask, c, opts.last_turn_only) is None for c in cuts)
