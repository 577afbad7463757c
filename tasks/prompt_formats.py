"""Normalise one source row (ShareGPT, OpenAI messages, `prompt`, `turns`) into a `PromptRecord`.

Assistant and tool turns in the source are dropped: the target regenerates every assistant turn, so the
dataset's own answers (and tool results that answered them) would only contradict it. What cannot be used
raises `RowError` with a short reason tag, which the stage writes to `rejected.jsonl`.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from draftsmith.tasks.prompt_pool import PromptRecord

# ShareGPT dumps use many speaker names; these are the ones seen in public corpora.
_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "function_call": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "function_response": "tool",
    "observation": "tool",
    "ipython": "tool",
}
_OPENAI_ROLES = {
    "user": "user",
    "assistant": "assistant",
    "system": "system",
    "developer": "system",
    "tool": "tool",
    "function": "tool",
    "ipython": "tool",
}
_SHAPES = ("conversations", "messages", "turns", "prompt")
# Benchmarks name their prompt field in many ways; these cover GSM8K, MATH, HumanEval, MT-Bench, Alpaca.
_REFERENCE_FIELDS = ("question", "problem", "instruction", "input", "query", "text")


class RowError(ValueError):
    """A row that cannot become a prompt. `reason` is the tag counted in the manifest."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def normalize_row(row: Any, *, default_id: str, default_category: str) -> PromptRecord:
    """Turn one parsed row into a record.

    Args:
        row: A JSON object (dict) with exactly one of `conversations` (ShareGPT `{from, value}`), `messages`
            (OpenAI `{role, content}`), `turns` (strings) or `prompt` (string); optional `id`, `category`,
            `system` and `tools` (list of OpenAI tool definitions, or that list as a JSON string).
        default_id: Id when the row has none.
        default_category: Category when the row has none.

    Raises:
        RowError: With reasons `malformed_row`, `unknown_format`, `ambiguous_format`, `missing_role`,
            `unknown_role`, `non_string_content`, `empty_turn`, `no_user_turn`, `system_after_user`,
            `conflicting_system`, `invalid_tools` or `invalid_field`.
    """
    if not isinstance(row, dict):
        raise RowError("malformed_row", f"row must be a JSON object, got {type(row).__name__}")
    shapes = [key for key in _SHAPES if key in row]
    if not shapes:
        raise RowError("unknown_format", f"row has none of {', '.join(_SHAPES)}; keys: {sorted(row)[:8]}")
    if len(shapes) > 1:
        raise RowError("ambiguous_format", f"row has several of {', '.join(shapes)}; keep one")
    system, turns = _conversation(row, shapes[0])
    row_system = row.get("system")
    if row_system is not None and not isinstance(row_system, str):
        raise RowError("non_string_content", f"field 'system' must be a string, got {type(row_system).__name__}")
    if row_system and row_system.strip() and system:
        raise RowError("conflicting_system", "both field 'system' and a system message are given; keep one")
    try:
        return PromptRecord(
            id=_text_field(row, "id") or default_id,
            category=_text_field(row, "category") or default_category,
            system=system or row_system,
            turns=turns,
            tools=_tools(row.get("tools")),
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        raise RowError("invalid_field", f"field {'.'.join(map(str, first['loc']))!r}: {first['msg']}") from None


def _text_field(row: dict[str, Any], key: str) -> str | None:
    value = row.get(key)
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and key == "id":
        return str(value)
    if not isinstance(value, str) or not value.strip():
        raise RowError("invalid_field", f"field {key!r} must be a non-empty string, got {value!r}")
    return value


def _conversation(row: dict[str, Any], shape: str) -> tuple[str | None, list[str]]:
    value = row[shape]
    if shape == "prompt":
        if not isinstance(value, str):
            raise RowError("non_string_content", f"field 'prompt' must be a string, got {type(value).__name__}")
        if not value.strip():
            raise RowError("empty_turn", "field 'prompt' is empty")
        return None, [value]
    if not isinstance(value, list) or not value:
        raise RowError("malformed_row", f"field {shape!r} must be a non-empty list, got {value!r}"[:200])
    if shape == "turns":
        messages = [(i, "user", turn) for i, turn in enumerate(value)]
    elif shape == "conversations":
        messages = [_message(m, i, shape, "from", "value", _SHAREGPT_ROLES) for i, m in enumerate(value)]
    else:
        messages = [_message(m, i, shape, "role", "content", _OPENAI_ROLES) for i, m in enumerate(value)]
    return _fold(messages, shape)


def _message(
    message: Any, index: int, shape: str, role_key: str, content_key: str, roles: dict[str, str]
) -> tuple[int, str, Any]:
    where = f"{shape}[{index}]"
    if not isinstance(message, dict):
        raise RowError("malformed_row", f"{where} must be an object, got {type(message).__name__}")
    if role_key not in message or message[role_key] is None:
        raise RowError("missing_role", f"{where} has no {role_key!r}")
    role = roles.get(str(message[role_key]).strip().lower())
    if role is None:
        raise RowError("unknown_role", f"{where}.{role_key} {message[role_key]!r} is not one of {sorted(roles)}")
    content = message.get(content_key)
    if role == "assistant" and content is None and (message.get("tool_calls") or message.get("function_call")):
        # An assistant turn that only calls tools is valid OpenAI; it is dropped like every assistant turn.
        content = "(tool call)"
    return index, role, _content_text(content, f"{where}.{content_key}")


def _content_text(content: Any, where: str) -> Any:
    # OpenAI's content-parts form: text parts are joined; anything else (images, audio) is not text.
    if isinstance(content, list) and content and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        texts = [p.get("text") for p in content]
        if all(isinstance(t, str) for t in texts):
            return "\n".join(texts)
    return content


def _fold(messages: list[tuple[int, str, Any]], shape: str) -> tuple[str | None, list[str]]:
    systems: list[str] = []
    turns: list[str] = []
    for index, role, content in messages:
        where = f"{shape}[{index}]"
        if not isinstance(content, str):
            raise RowError("non_string_content", f"{where}: {role} content must be a string, got {content!r}"[:300])
        if role == "tool":
            continue
        if role == "system":
            if turns:
                raise RowError("system_after_user", f"{where}: a system message after a user turn is not supported")
            systems.append(content)
            continue
        if not content.strip():
            raise RowError("empty_turn", f"{where}: {role} turn is empty")
        if role == "user":
            turns.append(content)
    if not turns:
        raise RowError("no_user_turn", f"field {shape!r} has no user turn")
    return "\n\n".join(s for s in systems if s.strip()) or None, turns


def _tools(value: Any) -> list[dict] | None:
    if value is None:
        return None
    if isinstance(value, str):
        # Function-calling corpora (Glaive, Hermes) often store the tool list as a JSON string.
        try:
            value = json.loads(value) if value.strip() else []
        except json.JSONDecodeError as exc:
            raise RowError("invalid_tools", f"field 'tools' is a string but not JSON: {exc.msg}") from None
    if not isinstance(value, list):
        raise RowError("invalid_tools", f"field 'tools' must be a list of tool definitions, got {type(value).__name__}")
    for index, tool in enumerate(value):
        name = _tool_name(tool)
        if not isinstance(name, str) or not name.strip():
            raise RowError("invalid_tools", f"tools[{index}] needs a name (OpenAI `function.name`), got {tool!r}"[:300])
    return value or None


def _tool_name(tool: Any) -> Any:
    if not isinstance(tool, dict):
        return None
    function = tool.get("function")
    return function.get("name") if isinstance(function, dict) else tool.get("name")


def reference_texts(row: Any) -> list[str]:
    """User texts of a benchmark row, for decontamination: any prompt shape, or a common prompt field.

    Raises:
        RowError: When the row holds no usable text.
    """
    if isinstance(row, dict) and not any(key in row for key in _SHAPES):
        texts = [row[k] for k in _REFERENCE_FIELDS if isinstance(row.get(k), str) and row[k].strip()]
        if texts:
            return texts
    record = normalize_row(row, default_id="benchmark", default_category="benchmark")
    return list(record.turns)
