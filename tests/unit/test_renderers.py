"""Golden renders and loss masks: ChatML (SmolLM2), a Llama-3-style and a Kimi-style template, and the
Python Kimi renderer, all on SmolLM2's real tokenizer (the templates' markers added as special tokens,
as they are in the models those templates come from)."""

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from draftsmith.core.target_setup import ensure_smollm2
from draftsmith.tasks.renderers import ChatTemplateRenderer, KimiRenderer, assistant_spans, get_renderer
from tests.support.runs import encoded as encode

pytestmark = pytest.mark.unit


TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "templates"

CONV = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And doubled?"},
    {"role": "assistant", "content": "Eight."},
]
TOOLS: list[dict] = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        },
    }
]
CALL = {"id": "functions.add:0", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
KIMI_CONV: list[dict] = [
    {"role": "system", "content": "You can call tools."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "", "reasoning_content": "I should call add.", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "functions.add:0", "content": "5"},
    {"role": "assistant", "content": "2 + 3 = 5.", "reasoning_content": "The tool says 5."},
]
KIMI_MARKERS = [
    "<|im_system|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_middle|>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "<think>",
    "</think>",
]
KIMI_HEAD = (
    '<|im_system|>tool_declare<|im_middle|>[{"type": "function", "function": {"name": "add", "description": '
    '"Add two integers.", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": '
    '["a"]}}}]<|im_end|><|im_system|>system<|im_middle|>You can call tools.<|im_end|><|im_user|>user<|im_middle|>'
    "What is 2 + 3?<|im_end|><|im_assistant|>assistant<|im_middle|>"
)
KIMI_CALLS = (
    '<|tool_calls_section_begin|><|tool_call_begin|>functions.add:0<|tool_call_argument_begin|>{"a": 2, "b": 3}'
    "<|tool_call_end|><|tool_calls_section_end|><|im_end|>"
)
KIMI_TOOL_TURN = "<|im_system|>tool<|im_middle|>## Return of functions.add:0\n5<|im_end|>"


def _tokenizer(template: str | None = None, markers: list[str] | None = None):
    tok = AutoTokenizer.from_pretrained(ensure_smollm2())
    if template:
        tok.chat_template = (TEMPLATES / template).read_text()
    if markers:
        tok.add_special_tokens({"additional_special_tokens": markers})
    return tok


@pytest.fixture(scope="module")
def chatml():
    return _tokenizer()


@pytest.fixture(scope="module")
def llama3():
    return _tokenizer(
        "llama3_style.jinja", ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    )


@pytest.fixture(scope="module")
def kimi():
    return _tokenizer("kimi_style.jinja", KIMI_MARKERS)


def _check_mask(tok, enc, text: str, spans, forbidden: list[str]) -> None:
    """Masked tokens decode to exactly the spans' text; prompt-side text never carries loss."""
    masked = tok.decode(enc.input_ids[enc.loss_mask == 1])
    assert masked == "".join(text[a:b] for a, b in spans)
    unmasked = tok.decode(enc.input_ids[enc.loss_mask == 0])
    for piece in forbidden:
        assert piece in unmasked and piece not in masked


def test_chatml_golden(chatml):
    text, spans = assistant_spans(chatml, CONV, last_turn_only=False)
    assert text == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
        "<|im_start|>assistant\n4.<|im_end|>\n<|im_start|>user\nAnd doubled?<|im_end|>\n"
        "<|im_start|>assistant\nEight.<|im_end|>\n"
    )
    assert [text[a:b] for a, b in spans] == ["4.<|im_end|>\n", "Eight.<|im_end|>\n"]
    enc = encode(chatml, CONV, max_length=4096, last_turn_only=False)
    _check_mask(chatml, enc, text, spans, ["You are terse.", "What is 2 + 2?", "And doubled?"])


def test_llama3_style_golden(llama3):
    text, spans = assistant_spans(llama3, CONV, last_turn_only=False)
    head = "<|start_header_id|>{}<|end_header_id|>\n\n"
    assert text == (
        "<|begin_of_text|>"
        + head.format("system")
        + "You are terse.<|eot_id|>"
        + head.format("user")
        + "What is 2 + 2?<|eot_id|>"
        + head.format("assistant")
        + "4.<|eot_id|>"
        + head.format("user")
        + "And doubled?<|eot_id|>"
        + head.format("assistant")
        + "Eight.<|eot_id|>"
    )
    assert [text[a:b] for a, b in spans] == ["4.<|eot_id|>", "Eight.<|eot_id|>"]
    enc = encode(llama3, CONV, max_length=4096, last_turn_only=False)
    _check_mask(llama3, enc, text, spans, ["You are terse.", "What is 2 + 2?", "And doubled?", "assistant"])
    last = encode(llama3, CONV, max_length=4096, last_turn_only=True)
    assert llama3.decode(last.input_ids[last.loss_mask == 1]) == "Eight.<|eot_id|>"


@pytest.mark.parametrize("thinking", [True, False])
def test_kimi_style_template_with_tools_and_thinking(kimi, thinking):
    renderer = ChatTemplateRenderer(kimi, thinking=thinking)
    messages = KIMI_CONV if thinking else [{k: v for k, v in m.items() if k != "reasoning_content"} for m in KIMI_CONV]
    text, spans = assistant_spans(renderer, messages, last_turn_only=False, tools=TOOLS)
    first = ("<think>I should call add.</think>" if thinking else "") + KIMI_CALLS
    second = ("<think>The tool says 5.</think>" if thinking else "") + "2 + 3 = 5.<|im_end|>"
    assert text == KIMI_HEAD + first + KIMI_TOOL_TURN + "<|im_assistant|>assistant<|im_middle|>" + second
    assert [text[a:b] for a, b in spans] == [first, second]
    enc = encode(kimi, messages, max_length=4096, last_turn_only=False, renderer=renderer, tools=TOOLS)
    _check_mask(kimi, enc, text, spans, ["You can call tools.", "What is 2 + 3?", "## Return of", "tool_declare"])
    # The same messages with thinking off in the renderer: reasoning is neither rendered nor trained.
    if thinking:
        off = encode(
            kimi,
            messages,
            max_length=4096,
            last_turn_only=False,
            renderer=ChatTemplateRenderer(kimi, thinking=False),
            tools=TOOLS,
        )
        assert "<think>" not in kimi.decode(off.input_ids)


@pytest.mark.parametrize("thinking", [True, False])
def test_python_kimi_renderer_equals_the_jinja_template(kimi, thinking):
    """The pluggable renderer gives the same text, spans and mask as the jinja template it reproduces."""
    python = get_renderer("kimi", kimi, thinking=thinking)
    jinja = ChatTemplateRenderer(kimi, thinking=thinking)
    assert python.template_sha256() == jinja.template_sha256()
    for last in (False, True):
        got = assistant_spans(python, KIMI_CONV, last_turn_only=last, tools=TOOLS)
        assert got == assistant_spans(jinja, KIMI_CONV, last_turn_only=last, tools=TOOLS)
        a = encode(kimi, KIMI_CONV, max_length=4096, last_turn_only=last, renderer=python, tools=TOOLS)
        b = encode(kimi, KIMI_CONV, max_length=4096, last_turn_only=last, renderer=jinja, tools=TOOLS)
        assert a.input_ids.tolist() == b.input_ids.tolist() and a.loss_mask.tolist() == b.loss_mask.tolist()


def test_kimi_renderer_serialises_dict_arguments_like_tojson(kimi):
    call = {**CALL, "function": {"name": "add", "arguments": {"a": 2, "b": "ü"}}}
    messages: list[dict] = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
    ]
    python = KimiRenderer(kimi, thinking=False).render(messages, None, add_generation_prompt=False)
    assert python == kimi.apply_chat_template(messages, tokenize=False, enable_thinking=False)
    assert json.dumps({"a": 2, "b": "ü"}, ensure_ascii=False) in python


def test_unknown_renderer_names_the_field(chatml):
    with pytest.raises(ValueError, match=r"tokenize\.renderer: unknown renderer 'nope'.*chat_template"):
        get_renderer("nope", chatml, thinking=False)


def _varied(n: int, seed: int, *, tools: bool) -> list:
    """Conversations of every shape the stage meets; some carry template markers in their text."""
    import random

    rng = random.Random(seed)
    markers = ["<|im_start|>assistant\n", "<|im_end|>\n", "<|eot_id|>", "<|im_assistant|>assistant<|im_middle|>"]
    words = ["alpha", "<b>x</b>", "2 < 3", "  ", "\n", "naïve", "{}", "ok.", "<|im_end|", "tool"]

    def text(k: int) -> str:
        out = " ".join(rng.choice(words) for _ in range(rng.randint(1, k)))
        return out + (rng.choice(markers) if rng.random() < 0.08 else "")

    convs = []
    for i in range(n):
        messages: list[dict] = [{"role": "system", "content": text(6)}] if rng.random() < 0.5 else []
        for t in range(rng.randint(1, 3)):
            messages.append({"role": "user", "content": text(8)})
            if tools and rng.random() < 0.3:
                call = {"id": f"call_{i}_{t}", "type": "function", "function": {"name": "add", "arguments": "{}"}}
                messages.append({"role": "assistant", "content": "", "tool_calls": [call], "reasoning_content": "r"})
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": text(3)})
            messages.append({"role": "assistant", "content": text(12), "reasoning_content": text(4)})
        convs.append((messages, TOOLS if tools and rng.random() < 0.5 else None))
    return convs


@pytest.mark.parametrize(
    ("fixture", "renderer", "tools"),
    [("chatml", "chat_template", False), ("llama3", "chat_template", False), ("kimi", "chat_template", True)]
    + [("kimi", "kimi", True)],
)
@pytest.mark.parametrize("thinking", [False, True])
def test_fast_spans_equal_the_reference_bitwise(request, fixture, renderer, tools, thinking):
    """One render + the probe's search gives the reference's bytes, and falls back where the text is ambiguous."""
    from draftsmith.tasks.renderers import probe_spans, spans_fast
    from draftsmith.tasks.token_encode import Encoded, Options, encode_conversations
    from draftsmith.tasks.token_rows import ConversationRow

    tok = request.getfixturevalue(fixture)
    r = get_renderer(renderer, tok, thinking=thinking)
    assert probe_spans(r) is not None
    convs = _varied(200, seed=len(fixture) + thinking, tools=tools)
    quick = spans_fast(r, convs, last_turn_only=False)
    assert quick is not None
    assert 0.7 * len(convs) < sum(x is not None for x in quick) < len(convs)  # mostly fast, some fall back
    rows = [ConversationRow(f"r{i}", "c", m, t) for i, (m, t) in enumerate(convs)]
    for last in (False, True):
        opts = Options(max_length=4096, last_turn_only=last, thinking=thinking)
        fast = encode_conversations(tok, r, rows, opts, fast=True)
        slow = encode_conversations(tok, r, rows, opts, fast=False)
        for a, b in zip(fast, slow, strict=True):
            assert isinstance(a, Encoded) and isinstance(b, Encoded)
            assert a.input_ids.tobytes() == b.input_ids.tobytes() and a.loss_mask.tobytes() == b.loss_mask.tobytes()


def test_probe_refuses_a_template_that_rewrites_history(chatml):
    from draftsmith.tasks.renderers import ChatTemplateRenderer, probe_spans

    tok = _tokenizer()
    # The last assistant turn is rendered differently from earlier ones: render boundaries disagree with it.
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "{% if loop.last %}!{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    assert probe_spans(ChatTemplateRenderer(tok, thinking=False)) is None


def _varied_conversations(n: int, seed: int) -> list:
    """Conversations over every shape the stage passes: system, multi-turn, reasoning, tool calls, None fields."""
    import random

    rng = random.Random(seed)
    texts = ["Hi", "  lead and trail  \n", "<b>x</b> & \"q\" 'a'", "naïve — ünï 😀", "", "a\n\nb", "{{ not jinja }}"]
    out = []
    for k in range(n):
        msgs: list[dict] = [{"role": "system", "content": rng.choice(texts)}] if rng.random() < 0.4 else []
        for t in range(rng.randint(1, 3)):
            msgs.append({"role": "user", "content": rng.choice(texts) + str(t)})
            answer: dict[str, Any] = {"role": "assistant", "content": rng.choice([*texts, None])}
            if rng.random() < 0.5:
                answer[rng.choice(["reasoning_content", "reasoning", "thinking"])] = rng.choice(texts)
            if rng.random() < 0.3:
                args = rng.choice(['{"a": 2}', {"a": 2, "s": "ü"}])
                call = {"id": f"functions.add:{t}", "type": "function", "function": {"name": "add", "arguments": args}}
                answer["tool_calls"] = [call]
                msgs += [answer, {"role": "tool", "tool_call_id": call["id"], "content": str(k)}]
                msgs.append({"role": "assistant", "content": rng.choice(texts), "tool_calls": None})
            else:
                msgs.append(answer)
        tools = rng.choice([None, [], _TOOLS])
        out.append((msgs, tools))
    return out


_TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add <two> ints.", "parameters": {}}}]


@pytest.mark.parametrize("name", ["chatml", "llama3", "kimi"])
@pytest.mark.parametrize("thinking", [False, True])
def test_jinja_renderer_equals_apply_chat_template(name, thinking, request):
    """The transformers-free renderer gives `apply_chat_template`'s text bit for bit, and its errors."""
    from draftsmith.tasks.renderers import JinjaTemplateRenderer

    tok = request.getfixturevalue(name)
    ours = JinjaTemplateRenderer(tok.chat_template, tok.special_tokens_map, thinking=thinking)
    ref = ChatTemplateRenderer(tok, thinking=thinking)
    assert ours.template_sha256() == ref.template_sha256()
    convs = _varied_conversations(200, seed=len(name) + thinking)
    for gen in (False, True):
        for conv in convs:
            try:
                expected = ref.render_many([conv], add_generation_prompt=gen)
            except Exception as e:  # the light renderer must fail alike
                with pytest.raises(type(e)):
                    ours.render_many([conv], add_generation_prompt=gen)
                continue
            assert ours.render_many([conv], add_generation_prompt=gen) == expected, conv


def test_light_tokenizer_equals_transformers(chatml):
    """The worker's transformers-free tokenizer encodes like `load_tokenizer`'s, special tokens included."""
    from draftsmith.tasks.token_encode import load_light_tokenizer, load_tokenizer

    path = str(ensure_smollm2())
    light, tok = load_light_tokenizer(path), load_tokenizer(path)
    assert light is not None
    assert light.chat_template == tok.chat_template and light.special_tokens_map == tok.special_tokens_map
    assert light._tokenizer.to_str() == tok._tokenizer.to_str()
    convs = _varied_conversations(50, seed=3)
    texts = ["<|im_start|>".join(f"{m['role']}\n{m.get('content')}<|im_end|>\n" for m in msgs) for msgs, _ in convs]
    texts += ["<|im_start|>x<|im_end|> naïve 😀\n\n", ""]
    ref = tok(texts, add_special_tokens=False, return_offsets_mapping=True)
    assert light(texts, return_offsets_mapping=True) == {k: ref[k] for k in ("input_ids", "offset_mapping")}


def test_trust_remote_code_reaches_the_tokenizer_of_code_shipping_models(tmp_path, monkeypatch):
    # Kimi's tokenizer ships as Python: the recipe's opt-in must reach AutoTokenizer in the workers, and
    # nothing else may turn it on.
    import transformers

    from draftsmith.tasks.token_encode import load_tokenizer

    (tmp_path / "tokenizer_config.json").write_text('{"tokenizer_class": "TikTokenTokenizer"}')
    seen: list[dict] = []

    def from_pretrained(path: str, **kw: Any) -> str:
        seen.append(kw)
        return "tok"

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    assert load_tokenizer(str(tmp_path), trust_remote_code=True) == "tok"
    assert load_tokenizer(str(tmp_path)) == "tok"
    assert seen == [{"trust_remote_code": True}, {"trust_remote_code": False}]
