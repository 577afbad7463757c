"""Encoding conversations for the tokenize stage: the length policy, the loss mask and the worker jobs.

Kept apart from the stage module so that spawned workers import only numpy, the tokenizer and the
renderers (not torch, Prefect or the stage machinery): worker start-up is most of a small run's time.
Workers return numpy arrays as bytes, never tensors.
"""

from __future__ import annotations

import json
import operator
import os
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from draftsmith.core import procs
from draftsmith.tasks import token_rows
from draftsmith.tasks.renderers import (
    JinjaTemplateRenderer,
    Renderer,
    Spans,
    _TokenizerAdapter,
    as_renderer,
    get_renderer,
    probe_spans,
    spans_fast,
    spans_many,
)
from draftsmith.tasks.token_rows import ConversationRow, PretokenizedRow, Rejected

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from draftsmith.core.config import TokenizeConfig


@dataclass(frozen=True)
class Encoded:
    """One tokenized sample: `input_ids` int32 `[S]`, `loss_mask` uint8 `[S]`."""

    input_ids: np.ndarray
    loss_mask: np.ndarray
    truncated: bool


@dataclass(frozen=True)
class Options:
    """What shapes a sample (and so keys the cache)."""

    max_length: int
    truncation: str = "truncate"
    last_turn_only: bool = False
    min_loss_tokens: int = 1
    thinking: bool = False
    vocab_size: int = 1 << 31
    trust_remote_code: bool = False  # only for tokenizers shipped as code, when the recipe opts in

    @classmethod
    def of(cls, cfg: TokenizeConfig, vocab_size: int, *, trust_remote_code: bool = False) -> Options:
        return cls(
            cfg.max_length,
            cfg.truncation,
            cfg.last_turn_only,
            cfg.min_loss_tokens,
            cfg.thinking == "on",
            vocab_size,
            trust_remote_code,
        )


def _mask(ids: Sequence[int], offsets: Sequence[tuple[int, int]], spans: Spans) -> Encoded:
    """Loss on tokens whose first character lies inside an assistant span."""
    arr = np.asarray(ids, dtype=np.int32)
    mask = np.zeros(len(arr), dtype=np.uint8)
    if not spans or not len(arr):
        return Encoded(arr, mask, False)
    starts = [s for s, _ in offsets]
    if all(map(operator.le, starts, starts[1:])):
        # Sorted starts (every byte-level BPE): the tokens starting in [lo, hi) are one index range.
        for lo, hi in spans:
            mask[bisect_left(starts, lo) : bisect_left(starts, hi)] = 1
        return Encoded(arr, mask, False)
    first = np.asarray(starts, dtype=np.int64)
    for lo, hi in spans:
        mask[(first >= lo) & (first < hi)] = 1
    return Encoded(arr, mask, False)


def _render_isolating(renderer: Renderer, convs: list, last_turn_only: bool, fast: bool = False) -> list:
    """`spans_many` on the batch; when it fails, row by row so that only the bad rows are rejected.

    With `fast`, conversations the renderer's probe can place take one render each (`spans_fast`); the
    rest, and every row of a renderer whose probe failed, go through the reference.
    """
    quick = None
    if fast and not isinstance(renderer, _TokenizerAdapter):
        try:
            quick = spans_fast(renderer, convs, last_turn_only=last_turn_only)
        except Exception:  # a render error is isolated to its rows by the reference below
            quick = None
    if quick is None:
        quick = [None] * len(convs)
    todo = [i for i, x in enumerate(quick) if x is None]
    if todo:
        for i, x in zip(todo, _reference_isolating(renderer, [convs[i] for i in todo], last_turn_only), strict=True):
            quick[i] = x
    return quick


def _reference_isolating(renderer: Renderer, convs: list, last_turn_only: bool) -> list:
    try:
        return spans_many(renderer, convs, last_turn_only=last_turn_only)
    except Exception:  # any template error is a per-row reject, found below
        pass
    out: list = []
    for conv in convs:
        try:
            out.extend(spans_many(renderer, [conv], last_turn_only=last_turn_only))
        except Exception as e:  # jinja raises anything; the row is rejected with the message
            out.append(Rejected("render_failed", f"{type(e).__name__}: {e}"[:500]))
    return out


def _tokenize(tok: PreTrainedTokenizerBase, texts: list[str], fast: bool) -> tuple[list, list]:
    """Token ids and character offsets of each text, as `tok(texts, return_offsets_mapping=True)` gives them.

    `fast` calls the Rust backend directly (what `tok` does inside) and skips building a `BatchEncoding`.
    """
    backend = getattr(tok, "_tokenizer", None)
    if fast and backend is not None and backend.truncation is None and backend.padding is None:
        encs = backend.encode_batch(texts, add_special_tokens=False)
        return [e.ids for e in encs], [e.offsets for e in encs]
    batch = tok(texts, add_special_tokens=False, return_offsets_mapping=True)
    return batch["input_ids"], batch["offset_mapping"]


def encode_conversations(
    tok: PreTrainedTokenizerBase,
    renderer: Renderer,
    rows: Sequence[ConversationRow],
    opts: Options,
    *,
    fast: bool = True,
) -> list[Encoded | Rejected | str]:
    """Each conversation as an `Encoded` fitted to `opts.max_length`, a `Rejected`, or a drop reason.

    `fast=False` takes the reference path throughout (boundary renders, `tok(...)`); both give equal bytes.
    """
    if not rows:
        return []
    rendered = _render_isolating(renderer, [(r.messages, r.tools) for r in rows], opts.last_turn_only, fast)
    good = [i for i, x in enumerate(rendered) if not isinstance(x, Rejected)]
    out: list[Encoded | Rejected | str] = list(rendered)
    if good:
        ids, offsets = _tokenize(tok, [rendered[i][0] for i in good], fast)
        for j, i in enumerate(good):
            enc = _mask(ids[j], offsets[j], rendered[i][1])
            out[i] = _fit(tok, renderer, rows[i], enc, opts)
    return out


def _fit(
    tok: PreTrainedTokenizerBase, renderer: Renderer, row: ConversationRow, enc: Encoded, opts: Options
) -> Encoded | Rejected | str:
    if len(enc.input_ids) <= opts.max_length:
        return enc
    if opts.truncation == "truncate":
        return Encoded(enc.input_ids[: opts.max_length], enc.loss_mask[: opts.max_length], True)
    if opts.truncation == "drop":
        return "too_long"
    messages = row.messages
    while True:  # keep_last_turns: drop the oldest user turn and its answers, keep the system prompt
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        if len(users) < 2:
            return "too_long"
        messages = messages[: users[0]] + messages[users[1] :]
        try:
            [(text, spans)] = spans_many(renderer, [(messages, row.tools)], last_turn_only=opts.last_turn_only)
        except Exception as e:  # a template may refuse the shortened conversation: this row only
            return Rejected("render_failed", f"keeping the last turns: {type(e).__name__}: {e}"[:500])
        b = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        if len(b["input_ids"]) <= opts.max_length:
            enc = _mask(b["input_ids"], b["offset_mapping"], spans)
            return Encoded(enc.input_ids, enc.loss_mask, True)


def _fit_pretokenized(row: PretokenizedRow, opts: Options) -> Encoded | str:
    if len(row.input_ids) <= opts.max_length:
        return Encoded(row.input_ids, row.loss_mask, False)
    if opts.truncation == "truncate":
        return Encoded(row.input_ids[: opts.max_length], row.loss_mask[: opts.max_length], True)
    return "too_long"  # `drop`, and `keep_last_turns`, which has no turn boundaries to cut at here


def encode(
    tok: PreTrainedTokenizerBase,
    messages: Sequence[dict],
    *,
    max_length: int,
    last_turn_only: bool,
    truncation: str = "truncate",
    renderer: Any = None,
    tools: list[dict] | None = None,
) -> Encoded | None:
    """Tokenize one conversation with its assistant-only mask; None when the truncation policy drops it.

    `renderer` defaults to `tok`'s own chat template; messages are used as given (no validation).
    """
    row = ConversationRow("-", "-", list(messages), tools)
    opts = Options(max_length, truncation, last_turn_only, 0)
    [out] = encode_conversations(tok, as_renderer(renderer if renderer is not None else tok), [row], opts)
    if isinstance(out, Rejected):
        raise ValueError(out.detail)
    return out if isinstance(out, Encoded) else None


_WORKER: dict[str, Any] = {}


# `AutoTokenizer` imports torch (through the model configs): seconds per spawned worker. A tokenizer saved as
# the generic backend class is what `AutoTokenizer` would build anyway, so that class is loaded directly.
_GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(tok_path: str, *, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The tokenizer `AutoTokenizer.from_pretrained(tok_path)` gives, without importing torch when possible."""
    config = Path(tok_path) / "tokenizer_config.json"
    try:
        cls = json.loads(config.read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        cls = None
    if cls in _GENERIC_CLASSES and (Path(tok_path) / "tokenizer.json").is_file():
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(tok_path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_path, trust_remote_code=trust_remote_code)


# Config keys with which the backend `AutoTokenizer` builds differs from tokenizer.json alone.
_LIGHT_UNSAFE = ("add_prefix_space", "split_special_tokens", "tokenizer_truncation", "tokenizer_padding")
_NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class LightTokenizer:
    """The Rust tokenizer and chat template of a generic tokenizer folder, loaded without transformers.

    Stands in for the `TokenizersBackend` that `load_tokenizer` gives where the stage needs it: `_tokenizer`
    (the Rust backend), `chat_template`, `special_tokens_map` and `tok(texts, ...)` with offsets.
    """

    def __init__(self, backend: Any, chat_template: str, special_tokens_map: dict[str, str]) -> None:
        self._tokenizer, self.chat_template, self.special_tokens_map = backend, chat_template, special_tokens_map

    def __call__(self, text: Any, *, add_special_tokens: bool = False, return_offsets_mapping: bool = False) -> dict:
        texts = [text] if isinstance(text, str) else list(text)
        encs = self._tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)
        out = {"input_ids": [e.ids for e in encs]}
        if return_offsets_mapping:
            out["offset_mapping"] = [e.offsets for e in encs]
        return {k: v[0] for k, v in out.items()} if isinstance(text, str) else out


def _special_token(value: Any) -> str | None:
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return value if isinstance(value, str) else None


def load_light_tokenizer(tok_path: str) -> LightTokenizer | None:
    """`load_tokenizer(tok_path)`'s tokenizer without importing transformers, or None where it could differ.

    Only a generic backend class with its tokenizer.json, a single template and none of the settings that
    make the backend rewrite tokenizer.json; tests prove encodings and renders equal to transformers'.
    """
    from tokenizers import Tokenizer

    folder = Path(tok_path)
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        # from_file parses in Rust: a JSON round trip through Python cost each worker ~0.13 s at start-up.
        backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
    except Exception:  # unreadable or not a tokenizers file: the transformers path decides
        return None
    if config.get("tokenizer_class") not in _GENERIC_CLASSES or any(k in config for k in _LIGHT_UNSAFE):
        return None
    if backend.truncation is not None or backend.padding is not None:
        return None
    added = {str(i): t.content for i, t in backend.get_added_tokens_decoder().items()}
    if any(added.get(i) != t.get("content") for i, t in config.get("added_tokens_decoder", {}).items()):
        return None
    template_file = folder / "chat_template.jinja"
    template = template_file.read_text() if template_file.is_file() else config.get("chat_template")
    if not isinstance(template, str) or (folder / "additional_chat_templates").exists():
        return None
    special = {k: _special_token(config.get(k)) for k in _NAMED_SPECIAL}
    return LightTokenizer(backend, template, {k: v for k, v in special.items() if v is not None})


def _load_for_worker(
    tok_path: str, renderer_name: str, thinking: bool, trust_remote_code: bool = False
) -> tuple[Any, Renderer]:
    """The tokenizer and renderer of a worker: the light pair when it reproduces the transformers one."""
    light = load_light_tokenizer(tok_path) if renderer_name == "chat_template" else None
    if light is not None:
        try:
            return light, JinjaTemplateRenderer(light.chat_template, light.special_tokens_map, thinking=thinking)
        except ValueError:
            pass  # a template only transformers can render
    tok = load_tokenizer(tok_path, trust_remote_code=trust_remote_code)
    return tok, get_renderer(renderer_name, tok, thinking=thinking)


def _init_worker(
    tok_path: str, renderer_name: str, opts: Options, pooled: bool = False, parent_pid: int | None = None
) -> None:
    if pooled:
        # One process per core already: a Rust thread pool per worker would oversubscribe the cores.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        # Its task queue outlives a SIGKILLed parent (every worker holds both ends): only the kernel ends it.
        procs.die_with_parent(parent_pid)
    # A pool initializer that raises is retried forever by multiprocessing: keep the error for the first job.
    _WORKER.clear()
    try:
        tok, renderer = _load_for_worker(tok_path, renderer_name, opts.thinking, opts.trust_remote_code)
    except Exception as e:  # re-raised by `_worker()` in the parent's first call
        _WORKER["error"] = e
        return
    probe_spans(renderer)  # learnt once per worker, before the first job
    _WORKER.update(tok=tok, renderer=renderer, opts=opts)


def _worker() -> dict[str, Any]:
    if "error" in _WORKER:
        raise _WORKER["error"]
    return _WORKER


def worker_template_sha256() -> str:
    """The sha256 of the template this worker's renderer reproduces."""
    return _worker()["renderer"].template_sha256()


def _process_lines(label: str, lines: list[tuple[int, bytes]]) -> list[tuple]:
    """Results in line order: `("ok", id, category, ids, mask, truncated)`, `("drop", reason)`,
    or `("reject", line, id, reason, detail, excerpt)`."""
    state = _worker()
    tok, renderer, opts = state["tok"], state["renderer"], state["opts"]
    rows = [
        token_rows.parse_line(raw, fallback_id=f"{label}:{n}", thinking=opts.thinking, vocab_size=opts.vocab_size)
        for n, raw in lines
    ]
    convs = [(i, r) for i, r in enumerate(rows) if isinstance(r, ConversationRow)]
    encoded = encode_conversations(tok, renderer, [r for _, r in convs], opts)
    fitted: dict[int, Any] = dict(zip([i for i, _ in convs], encoded, strict=True))
    out: list[tuple] = []
    for i, ((n, raw), row) in enumerate(zip(lines, rows, strict=True)):
        if i in fitted:
            res = fitted[i]
        else:
            res = row if isinstance(row, Rejected | ConversationRow) else _fit_pretokenized(row, opts)
        if isinstance(res, Rejected):
            excerpt = raw.decode("utf-8", "replace")
            out.append(("reject", n, res.row_id or getattr(row, "id", None), res.reason, res.detail, excerpt))
        elif isinstance(res, str):
            out.append(("drop", res))
        elif int(res.loss_mask.sum()) < opts.min_loss_tokens:
            out.append(("drop", "min_loss_tokens"))
        else:
            assert not isinstance(row, Rejected)
            out.append(("ok", row.id, row.category, res.input_ids.tobytes(), res.loss_mask.tobytes(), res.truncated))
    return out


@dataclass
class Chunk:
    """The results of one job, packed for the parent: kept samples concatenated, drops counted.

    `ids` int32 and `mask` uint8 bytes `[T]`, `lengths` int64 bytes `[n]`; `rejects` as `Rejects` rows.
    """

    rows: int = 0
    ids: bytes = b""
    mask: bytes = b""
    lengths: bytes = b""
    row_ids: list = field(default_factory=list)
    categories: list = field(default_factory=list)
    truncated: int = 0
    loss_tokens: int = 0
    drops: dict = field(default_factory=dict)
    rejects: list = field(default_factory=list)


def pack_results(results: list[tuple]) -> Chunk:
    """`_process_lines` results as one `Chunk` (one join per array instead of a message per row)."""
    out = Chunk(rows=len(results))
    ids, masks, lengths = [], [], []
    for res in results:
        if res[0] == "ok":
            _, rid, cat, row_ids, mask, truncated = res
            out.row_ids.append(rid)
            out.categories.append(cat)
            ids.append(row_ids)
            masks.append(mask)
            lengths.append(len(mask))
            out.truncated += int(truncated)
        elif res[0] == "drop":
            out.drops[res[1]] = out.drops.get(res[1], 0) + 1
        else:
            _, line, rid, reason, detail, excerpt = res
            out.rejects.append({"line": line, "id": rid, "reason": reason, "detail": detail, "excerpt": excerpt})
    out.ids, out.mask = b"".join(ids), b"".join(masks)
    out.lengths = np.asarray(lengths, np.int64).tobytes()
    out.loss_tokens = int(np.frombuffer(out.mask, np.uint8).sum(dtype=np.int64))
    return out


def _process_job(job: tuple) -> tuple:
    shard, chunk, n_chunks, label, lines = job
    return shard, chunk, n_chunks, None if lines is None else pack_results(_process_lines(label, lines))
