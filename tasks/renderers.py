"""Conversation renderers and the render-boundary loss mask.

A renderer turns messages into the target's prompt text. `chat_template` uses the tokenizer's own jinja
template; a registered Python renderer stands in for templates that `apply_chat_template` cannot express
(Kimi's tool-call sections, for instance). Either way the loss mask comes from render boundaries: the
prefix rendered with `add_generation_prompt=True` ends where assistant turn i begins, the conversation
rendered through turn i ends where it stops, and characters between are assistant text. The check that
each render extends the previous one is what makes this valid for any template.

That reference costs 2 renders per assistant turn on top of the full text. `SpanProbe` learns once per
renderer the generation prompt and end-of-turn text around assistant content, so most conversations need
only their full render plus string searches; the probe enables this only after the fast spans reproduce the
reference on varied probe conversations, and any conversation whose text makes the search ambiguous falls
back to the reference.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from draftsmith.engines.base import template_hash

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Conversation = tuple[list[dict], list[dict] | None]  # (messages, tools)
Spans = list[tuple[int, int]]


class PrefixUnstableError(ValueError):
    """The template rewrites earlier turns as the conversation grows, so boundaries cannot place a mask."""


class Renderer(Protocol):
    """Renders conversations to text; `render_many` lets a renderer batch its work."""

    name: str

    def render_many(self, convs: Sequence[Conversation], *, add_generation_prompt: bool) -> list[str]:
        """One text per conversation, in order."""
        ...

    def template_sha256(self) -> str:
        """sha256 of the chat template this renderer reproduces (checked against the corpus provenance)."""
        ...


class ChatTemplateRenderer:
    """The tokenizer's own chat template through `apply_chat_template`, batched per distinct tool list."""

    name = "chat_template"

    def __init__(self, tok: PreTrainedTokenizerBase, *, thinking: bool) -> None:
        if not isinstance(tok.chat_template, str) or not tok.chat_template:
            raise ValueError("tokenize.renderer: the target tokenizer has no single chat template; pick a renderer")
        self.tok = tok
        # Qwen3-style templates read `enable_thinking`; templates that ignore it are unaffected.
        self.kwargs: dict[str, Any] = {"enable_thinking": thinking}

    def render_many(self, convs: Sequence[Conversation], *, add_generation_prompt: bool) -> list[str]:
        out: list[str] = [""] * len(convs)
        groups: dict[str, list[int]] = {}
        for i, (_, tools) in enumerate(convs):
            groups.setdefault(json.dumps(tools, sort_keys=True), []).append(i)
        for idx in groups.values():
            tools = convs[idx[0]][1]
            texts = self.tok.apply_chat_template(
                [convs[i][0] for i in idx],
                tools=tools,  # type: ignore[arg-type]  # transformers types tools as an invariant list of dict | Callable
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **self.kwargs,
            )
            for i, text in zip(idx, texts, strict=True):
                out[i] = text
        return out

    def template_sha256(self) -> str:
        return template_hash(self.tok.chat_template)


class JinjaTemplateRenderer:
    """What `ChatTemplateRenderer` renders, without transformers: the template compiled as `apply_chat_template`
    compiles it (transformers' `_compile_jinja_template`), given the same variables and message normalisation.

    Workers use it so that they never import transformers (most of their start-up); `compile_chat_template`
    returns None for templates it cannot reproduce, and tests prove equality with `apply_chat_template`.
    """

    name = "chat_template"

    def __init__(self, template: str, special_tokens: dict[str, str], *, thinking: bool) -> None:
        compiled = compile_chat_template(template)
        if compiled is None:
            raise ValueError("tokenize.renderer: this chat template needs transformers' own renderer")
        self.template, self.compiled = template, compiled
        # `apply_chat_template` passes the named special tokens, overridden by the template kwargs.
        self.variables = {**special_tokens, "enable_thinking": thinking}

    def render_many(self, convs: Sequence[Conversation], *, add_generation_prompt: bool) -> list[str]:
        render, variables = self.compiled.render, self.variables
        return [
            render(
                messages=[_normalise(m) for m in messages],
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
            for messages, tools in convs
        ]

    def template_sha256(self) -> str:
        return template_hash(self.template)


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _normalise(message: dict) -> dict:
    """`apply_chat_template`'s message: keys whose value is None dropped, reasoning aliased under its names."""
    out = {k: v for k, v in message.items() if v is not None}
    reasoning = next((out[k] for k in _REASONING_FIELDS if k in out), None)
    return out if reasoning is None else {"thinking": reasoning, **out, "reasoning_content": reasoning}


def compile_chat_template(template: str) -> Any:
    """The jinja template `apply_chat_template` would run, or None when only transformers can run it.

    Mirrors transformers' `_cached_compile_jinja_template`; the `{% generation %}` tag (its assistant tracker)
    is not supported here, so such templates return None and take the transformers path.
    """
    import re

    import jinja2
    import jinja2.ext
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if re.search(r"\{%-?\s*(end)?generation\s*-?%\}", template):
        return None

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        from datetime import datetime

        return datetime.now().strftime(format)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                    "Please rename the attribute."
                )

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(
        raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(), namespace=TemplateNamespace
    )
    return env.from_string(template)


class _TokenizerAdapter:
    """Lets any object with `apply_chat_template` act as a renderer (tests use one that rewrites history)."""

    name = "adapter"

    def __init__(self, tok: Any) -> None:
        self.tok = tok

    def render_many(self, convs: Sequence[Conversation], *, add_generation_prompt: bool) -> list[str]:
        return [
            self.tok.apply_chat_template(list(m), add_generation_prompt=add_generation_prompt, tokenize=False)
            for m, _ in convs
        ]

    def template_sha256(self) -> str:
        return template_hash(getattr(self.tok, "chat_template", None))


class KimiRenderer:
    """Kimi-style chat format written in Python: `<|im_user|>` headers, `<think>` reasoning, tool-call sections.

    Tool calls render as `<|tool_calls_section_begin|>` ... with the arguments string verbatim, and tool
    results as `## Return of <id>` system turns, which is what a jinja `tojson` would re-serialise. It is
    prefix-stable by construction: each message renders independently of the ones after it.
    """

    name = "kimi"
    SPEC_VERSION = "kimi-style-v1"

    def __init__(self, tok: PreTrainedTokenizerBase | None = None, *, thinking: bool) -> None:
        self.thinking = thinking
        template = getattr(tok, "chat_template", None)
        self.template = template if isinstance(template, str) and template else None

    def render_many(self, convs: Sequence[Conversation], *, add_generation_prompt: bool) -> list[str]:
        return [self.render(m, tools, add_generation_prompt=add_generation_prompt) for m, tools in convs]

    def render(self, messages: Sequence[dict], tools: list[dict] | None, *, add_generation_prompt: bool) -> str:
        parts = []
        if tools:
            declared = json.dumps(tools, ensure_ascii=False)
            parts.append(f"<|im_system|>tool_declare<|im_middle|>{declared}<|im_end|>")
        for msg in messages:
            parts.append(self._message(msg))
        if add_generation_prompt:
            parts.append("<|im_assistant|>assistant<|im_middle|>")
        return "".join(parts)

    def _message(self, msg: dict) -> str:
        role, content = msg["role"], msg.get("content") or ""
        if role == "tool":
            return f"<|im_system|>tool<|im_middle|>## Return of {msg.get('tool_call_id', '')}\n{content}<|im_end|>"
        if role != "assistant":
            header = "<|im_user|>user" if role == "user" else "<|im_system|>system"
            return f"{header}<|im_middle|>{content}<|im_end|>"
        body = f"<think>{msg['reasoning_content']}</think>" if self.thinking and msg.get("reasoning_content") else ""
        body += content
        calls = msg.get("tool_calls") or []
        if calls:
            body += "<|tool_calls_section_begin|>"
            for call in calls:
                fn = call["function"]
                args = (
                    fn["arguments"]
                    if isinstance(fn["arguments"], str)
                    else json.dumps(fn["arguments"], ensure_ascii=False)
                )
                body += f"<|tool_call_begin|>{call['id']}<|tool_call_argument_begin|>{args}<|tool_call_end|>"
            body += "<|tool_calls_section_end|>"
        return f"<|im_assistant|>assistant<|im_middle|>{body}<|im_end|>"

    def template_sha256(self) -> str:
        # It stands in for the target's own template (which regenerate's engine rendered with), so that is the
        # identity to check; a tokenizer without a template falls back to this format's version.
        return template_hash(self.template or self.SPEC_VERSION)


RENDERERS: dict[str, Callable[..., Renderer]] = {"chat_template": ChatTemplateRenderer, "kimi": KimiRenderer}


def register_renderer(name: str, factory: Callable[..., Renderer]) -> None:
    """Add a renderer under `name`; `factory(tok, thinking=bool)` builds it."""
    if name in RENDERERS:
        raise ValueError(f"renderer {name!r} is already registered")
    RENDERERS[name] = factory


def get_renderer(name: str, tok: PreTrainedTokenizerBase, *, thinking: bool) -> Renderer:
    if name not in RENDERERS:
        raise ValueError(f"tokenize.renderer: unknown renderer {name!r}; registered: {sorted(RENDERERS)}")
    return RENDERERS[name](tok, thinking=thinking)


def as_renderer(obj: Any) -> Renderer:
    return obj if hasattr(obj, "render_many") else _TokenizerAdapter(obj)


def spans_many(renderer: Renderer, convs: Sequence[Conversation], *, last_turn_only: bool) -> list[tuple[str, Spans]]:
    """Rendered text and assistant character spans `[(start, end)]` of each conversation.

    Three batched render calls cover every conversation: full texts, generation prefixes of every
    assistant turn, and renders through every assistant turn except the last message (that one is the
    full text). Raises `PrefixUnstableError` naming the message where a boundary does not hold.
    """
    full = renderer.render_many(convs, add_generation_prompt=False)
    heads: list[tuple[int, int]] = []  # (conversation, assistant message index)
    for c, (messages, _) in enumerate(convs):
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        heads.extend((c, i) for i in (turns[-1:] if last_turn_only else turns))
    prefixes = renderer.render_many([(convs[c][0][:i], convs[c][1]) for c, i in heads], add_generation_prompt=True)
    inner = [(c, i) for c, i in heads if i + 1 < len(convs[c][0])]
    throughs = dict(
        zip(
            inner,
            renderer.render_many([(convs[c][0][: i + 1], convs[c][1]) for c, i in inner], add_generation_prompt=False),
            strict=True,
        )
    )
    out: list[tuple[str, Spans]] = [(text, []) for text in full]
    for (c, i), prefix in zip(heads, prefixes, strict=True):
        text = full[c]
        through = throughs.get((c, i), text)
        if not (through.startswith(prefix) and text.startswith(through)):
            why = (
                "the conversation opens with an assistant turn, and the template renders something before it "
                "(a default system prompt?) that it leaves out of an empty conversation's generation prompt"
                if i == 0
                else "render boundaries cannot place the loss mask; use a renderer for this template "
                "(tokenize.renderer)"
            )
            raise PrefixUnstableError(f"chat template is not prefix-stable at message {i}: {why}")
        out[c][1].append((len(prefix), len(through)))
    return out


def assistant_spans(
    renderer: Any, messages: Sequence[dict], *, last_turn_only: bool, tools: list[dict] | None = None
) -> tuple[str, Spans]:
    """The rendered conversation and the character spans of its assistant turns."""
    [(text, spans)] = spans_many(as_renderer(renderer), [(list(messages), tools)], last_turn_only=last_turn_only)
    return text, spans


# ---- the probe: one render per conversation -----------------------------------------------------------

_USER, _ASSISTANT, _OTHER = "zqxUSERqxz", "zqxASSISTANTqxz", "zqxOTHERqxz"
_PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        },
    }
]


@dataclass(frozen=True)
class SpanProbe:
    """What a renderer writes around assistant content, learnt from sentinel renders.

    `gen` is the generation prompt (where an assistant span starts), `end` the text that closes an assistant
    turn (where an inner span stops) and `end_count` how often `end` occurs in one message of each role.
    Both strings are border-free (no proper prefix is also a suffix), so their occurrences never overlap and
    a count equal to the structural one proves that every occurrence is one the template wrote.
    """

    gen: str
    end: str
    end_count: dict[str, int]

    def locate(self, messages: Sequence[dict], text: str) -> Spans | None:
        """Spans of every assistant turn in `text`, or None when the search cannot be proven unambiguous."""
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if turns[:1] == [0]:
            # Only renders can tell where an opening assistant turn starts: a template may put a preamble (a
            # default system prompt) before the first message that the empty conversation's render lacks.
            return None
        if text.count(self.gen) != len(turns):
            return None  # message text contains the generation prompt: only renders can place the spans
        spans: Spans = []
        start = 0
        for n, i in enumerate(turns):
            a = text.index(self.gen, start) + len(self.gen)
            if i == len(messages) - 1:
                b = len(text)
            else:
                stop = text.index(self.gen, a) if n + 1 < len(turns) else len(text)
                between = messages[i + 1 : turns[n + 1] if n + 1 < len(turns) else len(messages)]
                expected = 1 + sum(self.end_count.get(m["role"], -len(text) - 1) for m in between)
                if text.count(self.end, a, stop) != expected:
                    return None
                b = text.index(self.end, a) + len(self.end)
            content = (messages[i].get("content") or "").strip()
            if content and content not in text[a:b]:
                return None
            spans.append((a, b))
            start = b
        return spans


def _border_free(s: str) -> bool:
    return bool(s) and all(s[:k] != s[-k:] for k in range(1, len(s)))


def _learn(renderer: Renderer) -> SpanProbe | None:
    def render(messages: list[dict], gen: bool) -> str:
        return renderer.render_many([(messages, None)], add_generation_prompt=gen)[0]

    user, assistant = {"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT}
    base, head, through = render([user], False), render([user], True), render([user, assistant], False)
    if not (head.startswith(base) and through.startswith(head) and _ASSISTANT in through[len(head) :]):
        return None
    gen = head[len(base) :]
    end = through[through.index(_ASSISTANT, len(head)) + len(_ASSISTANT) :]
    if not (_border_free(gen) and _border_free(end)):
        return None
    counts: dict[str, int] = {}
    for role in ("system", "user", "tool"):
        msg = {"role": role, "content": _OTHER} | ({"tool_call_id": "call_0"} if role == "tool" else {})
        try:
            text = render([user, assistant, msg], False)
        except Exception:  # a template may refuse a role; conversations with it take the reference
            continue
        if text.startswith(through):
            counts[role] = text[len(through) :].count(end)
    return SpanProbe(gen, end, counts)


def _probe_conversations() -> list[Conversation]:
    """Shapes the fast spans must reproduce exactly before they are trusted."""
    system = {"role": "system", "content": "You are terse.\n"}
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}
    out: list[Conversation] = []
    for turns in (1, 3):
        msgs: list[dict] = []
        for t in range(turns):
            msgs += [
                {"role": "user", "content": f"  Question {t}: is <b>{t}</b> < {t + 1}?\n"},
                {"role": "assistant", "content": f"\nYes, {t} < {t + 1}; see <b>.\n\n", "reasoning_content": "Easy."},
            ]
        out += [(msgs, None), ([system, *msgs], None)]
    tool_turn: list[dict] = [
        {"role": "user", "content": "Add 2."},
        {"role": "assistant", "content": "", "tool_calls": [call], "reasoning_content": "Call add."},
        {"role": "tool", "tool_call_id": "call_1", "content": "4"},
        {"role": "assistant", "content": "It is 4."},
    ]
    out += [(tool_turn, _PROBE_TOOLS), ([system, *tool_turn], _PROBE_TOOLS)]
    return out


# Each renderer's probe result, learned once per renderer object.
_PROBES: weakref.WeakKeyDictionary[Renderer, SpanProbe | None] = weakref.WeakKeyDictionary()


def probe_spans(renderer: Renderer) -> SpanProbe | None:
    """The renderer's `SpanProbe` when fast spans equal the reference on every probe conversation, else None.

    Cached on the renderer; the reference's own failures (a template that is not prefix-stable, or that
    refuses a shape) disable the fast path, so every row meets the reference's behaviour.
    """
    if renderer in _PROBES:
        return _PROBES[renderer]
    probe = None
    try:
        probe = _learn(renderer)
        for conv in _probe_conversations() if probe is not None else []:
            assert probe is not None
            fast = _fast_spans(probe, renderer, [conv])[0]
            [reference] = spans_many(renderer, [conv], last_turn_only=False)
            if fast != reference:
                probe = None
                break
    except Exception:  # any failure means the reference handles every row
        probe = None
    _PROBES[renderer] = probe
    return probe


def _fast_spans(probe: SpanProbe, renderer: Renderer, convs: Sequence[Conversation]) -> list:
    texts = renderer.render_many(convs, add_generation_prompt=False)
    out = []
    for (messages, _), text in zip(convs, texts, strict=True):
        spans = probe.locate(messages, text)
        out.append(None if spans is None else (text, spans))
    return out


def spans_fast(renderer: Renderer, convs: Sequence[Conversation], *, last_turn_only: bool) -> list | None:
    """Like `spans_many` with one render per conversation; None entries need the reference (`spans_many`).

    None as a whole when the renderer's probe failed. Raises whatever the batched render raises.
    """
    probe = probe_spans(renderer)
    if probe is None:
        return None
    out = _fast_spans(probe, renderer, convs)
    if last_turn_only:
        out = [None if x is None else (x[0], x[1][-1:]) for x in out]
    return out
