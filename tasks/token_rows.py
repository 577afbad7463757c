"""Parsing and validation of tokenize input rows: conversations or pretokenized samples.

Each raw JSONL line becomes a `Conversation` or `Pretokenized` row, or a `Rejected` with a reason tag
(`malformed_json`, `missing_role`, ...) and a message naming the offending field, so that one bad row
lands in `rejected.jsonl` instead of failing a 150K-row stage.
"""

from __future__ import annotations

import reprlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

ROLES = ("system", "user", "assistant", "tool")
_KEPT_KEYS = ("role", "content", "reasoning_content", "tool_calls", "tool_call_id", "name")


@dataclass(frozen=True)
class Rejected:
    reason: str
    detail: str
    row_id: str | None = None


@dataclass(frozen=True)
class ConversationRow:
    id: str
    category: str
    messages: list[dict]
    tools: list[dict] | None


@dataclass(frozen=True)
class PretokenizedRow:
    """A sample tokenized upstream: `input_ids` int32 `[S]`, `loss_mask` uint8 `[S]`."""

    id: str
    category: str
    input_ids: np.ndarray
    loss_mask: np.ndarray


Row = ConversationRow | PretokenizedRow | Rejected


def parse_line(raw: bytes, *, fallback_id: str, thinking: bool, vocab_size: int) -> Row:
    """One JSONL line to a validated row, or the reason it cannot be used."""
    try:
        # orjson parses bytes and checks UTF-8 itself, about 3x faster than decode + json.loads; this
        # loop is a measurable share of the stage's per-row cost.
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as u:
            return Rejected("invalid_utf8", f"not UTF-8 at byte {u.start}")
        return Rejected("malformed_json", f"invalid JSON: {e}")
    if not isinstance(obj, dict):
        return Rejected("malformed_json", f"a row must be a JSON object, got {type(obj).__name__}")
    ident = _identity(obj, fallback_id)
    if isinstance(ident, Rejected):
        return ident
    row_id, category = ident
    if "input_ids" in obj or "loss_mask" in obj:
        return _pretokenized(obj, row_id, category, vocab_size)
    if "messages" not in obj:
        return Rejected("missing_messages", "row has neither `messages` nor `input_ids` + `loss_mask`", row_id)
    messages = obj["messages"]
    if not isinstance(messages, list) or not messages:
        return Rejected("missing_messages", "messages: must be a non-empty list", row_id)
    tools = obj.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        return Rejected("bad_field", "tools: must be a list of objects", row_id)
    clean = []
    for i, msg in enumerate(messages):
        checked = _message(msg, i, thinking)
        if isinstance(checked, Rejected):
            return Rejected(checked.reason, checked.detail, row_id)
        clean.append(checked)
    if clean[-1]["role"] != "assistant":
        return Rejected(
            "no_final_assistant_turn",
            f"messages[{len(clean) - 1}]: conversation ends with a {clean[-1]['role']!r} turn, not an assistant turn",
            row_id,
        )
    return ConversationRow(row_id, category, clean, tools or None)


# A reason is one short line: a field's value is shown cut (reprlib stops at a depth, where repr() would
# recurse through a row nested 1000 deep, which orjson accepts, and raise).
_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60


def _shown(value: Any) -> str:
    return _REPR.repr(value)


def _identity(obj: dict, fallback_id: str) -> tuple[str, str] | Rejected:
    row_id = obj.get("id", fallback_id)
    if not isinstance(row_id, str) or not row_id:
        return Rejected("bad_field", f"id: must be a non-empty string, got {_shown(row_id)}")
    category = obj.get("category", "unknown")
    if not isinstance(category, str):
        return Rejected("bad_field", f"category: must be a string, got {_shown(category)}", row_id)
    return row_id, category


def _message(msg: Any, i: int, thinking: bool) -> dict | Rejected:
    where = f"messages[{i}]"
    if not isinstance(msg, dict):
        return Rejected("bad_field", f"{where}: must be an object")
    role = msg.get("role")
    if role is None:
        return Rejected("missing_role", f"{where}: has no role")
    if role not in ROLES:
        return Rejected("unknown_role", f"{where}.role: {_shown(role)} is not one of {list(ROLES)}")
    calls = msg.get("tool_calls") or None
    if calls is not None and (role != "assistant" or not _valid_calls(calls)):
        return Rejected("bad_field", f"{where}.tool_calls: must be assistant calls with function name and arguments")
    content = msg.get("content")
    if content is None and calls:
        content = ""  # OpenAI sends `content: null` beside tool calls
    if not isinstance(content, str):
        return Rejected("non_string_content", f"{where}.content: must be a string, got {type(content).__name__}")
    reasoning = msg.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        return Rejected("non_string_content", f"{where}.reasoning_content: must be a string")
    out = {k: msg[k] for k in _KEPT_KEYS if msg.get(k) is not None}
    out["content"] = content
    if not thinking:
        out.pop("reasoning_content", None)  # thinking off: reasoning is neither rendered nor trained
    if role == "assistant" and not content.strip() and not calls and not (out.get("reasoning_content") or "").strip():
        return Rejected("empty_assistant_turn", f"{where}: assistant turn has no content, reasoning or tool calls")
    return out


def _valid_calls(calls: Any) -> bool:
    if not isinstance(calls, list):
        return False
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or "arguments" not in fn:
            return False
    return True


def _pretokenized(obj: dict, row_id: str, category: str, vocab_size: int) -> Row:
    ids, mask = obj.get("input_ids"), obj.get("loss_mask")
    if not (isinstance(ids, list) and isinstance(mask, list)):
        return Rejected("bad_pretokenized", "input_ids and loss_mask: both must be lists of integers", row_id)
    if len(ids) != len(mask) or not ids:
        return Rejected(
            "bad_pretokenized",
            f"input_ids ({len(ids)}) and loss_mask ({len(mask)}): need equal non-zero length",
            row_id,
        )
    if not all(type(t) is int for t in ids) or not all(m in (0, 1) and type(m) is int for m in mask):
        return Rejected("bad_pretokenized", "input_ids: integers; loss_mask: 0 or 1 only", row_id)
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= vocab_size:
        return Rejected(
            "bad_pretokenized", f"input_ids: {hi if hi >= vocab_size else lo} outside [0, {vocab_size})", row_id
        )
    return PretokenizedRow(row_id, category, np.asarray(ids, np.int32), np.asarray(mask, np.uint8))
