"""The in-process Hugging Face target engine: the embedded default on CPU.

`HFEngine` is the `TargetEngine` regeneration uses; `chat_generate` is the same batched call on plain
message lists; `TapRecorder`/`forward_with_taps` serve the hidden-state and evaluation stages.

Shape legend: B batch, S sequence, H target hidden size, N number of taps, V target vocabulary.
"""

import functools
import logging
import re
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DynamicCache,
    GenerationMixin,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from draftsmith.core.config import TargetConfig
from draftsmith.core.target_setup import resolve_target
from draftsmith.engines.base import ChatRequest, Completion, SamplingParams, template_hash
from draftsmith.engines.taps import validate_taps

log = logging.getLogger(__name__)

Message = dict[str, Any]


@functools.lru_cache(maxsize=2)
def _load(path: str, dtype: str, trust_remote_code: bool) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code)
    model.eval()
    model.requires_grad_(False)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model, tok


def load_target(cfg: TargetConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load (once per process) the target model and tokenizer, checking the recipe's declared shape."""
    path = str(resolve_target(cfg.source))
    model, tok = _load(path, cfg.compute_dtype, cfg.trust_remote_code)
    mc = model.config
    declared = (cfg.num_layers, cfg.hidden_size, cfg.vocab_size)
    actual = (mc.num_hidden_layers, mc.hidden_size, mc.vocab_size)
    if declared != actual:
        raise ValueError(
            f"target: the recipe declares (num_layers, hidden_size, vocab_size)={declared} but {path} has {actual}"
        )
    return model, tok


def decoder_parts(model: PreTrainedModel) -> tuple[Any, nn.ModuleList, nn.Module]:
    """The base decoder, its layer list and its final norm (Llama-style models; the decoder is typed by the
    attributes callers use: `embed_tokens`, `rotary_emb`)."""
    base = model.get_decoder()
    return base, base.layers, base.norm


def end_of_turn_ids(tok: PreTrainedTokenizerBase, model: PreTrainedModel) -> list[int]:
    ids = model.generation_config.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tok.eos_token_id is not None and tok.eos_token_id not in ids:
        ids.append(tok.eos_token_id)
    return ids


def _text(rendered: object) -> str:
    """A rendering or decoding that is text (`tokenize=False`, one sequence): transformers types it as a union."""
    assert isinstance(rendered, str), type(rendered)
    return rendered


def generate_texts(
    model: PreTrainedModel,
    tok: PreTrainedTokenizerBase,
    texts: Sequence[str],
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    n: int = 1,
) -> list[list[Completion]]:
    """One left-padded `generate` over rendered prompts; `n` completions per prompt, in prompt order.

    Greedy decoding (temperature 0) cannot draw distinct samples, so its single answer is repeated n times.
    """
    enc = tok(list(texts), return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    eos = end_of_turn_ids(tok, model)
    sampling = {"temperature": temperature, "top_p": top_p} if temperature > 0 else {}
    draws = n if temperature > 0 else 1
    out_BS = cast(GenerationMixin, model).generate(  # a causal LM: PreTrainedModel's type lacks the mixin
        **enc,
        max_new_tokens=max_new_tokens,
        pad_token_id=tok.pad_token_id,
        eos_token_id=eos,
        do_sample=temperature > 0,
        num_return_sequences=draws,
        **sampling,
    )
    flat = []
    for row in out_BS[:, enc["input_ids"].shape[1] :].tolist():
        stop = next((i for i, t in enumerate(row) if t in eos), None)
        body = row if stop is None else row[:stop]
        text = _text(tok.decode(body, skip_special_tokens=True)).strip()
        # Counted like vLLM and OpenAI usage: the end-of-turn token is a generated token too.
        generated = len(row) if stop is None else stop + 1
        flat.append(Completion(text=text, num_tokens=generated, finish_reason="length" if stop is None else "stop"))
    # generate() returns the draws of prompt i at rows i*draws .. i*draws+draws-1.
    return [flat[i * draws : (i + 1) * draws] * (n // draws) for i in range(len(texts))]


@torch.inference_mode()
def chat_generate(
    model: PreTrainedModel,
    tok: PreTrainedTokenizerBase,
    conversations: Sequence[list[Message]],
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
) -> list[Completion]:
    """Answer each conversation's last user turn with one batched `generate` call (left padding)."""
    texts = [_text(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False)) for c in conversations]
    outs = generate_texts(model, tok, texts, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
    return [o[0] for o in outs]


_THINK = re.compile(r"^\s*(?:<think>)?(?P<reasoning>.*?)</think>\s*(?P<answer>.*)$", re.DOTALL)


def split_reasoning(completion: Completion) -> Completion:
    """Move a leading `<think>...</think>` block (thinking models) from the answer into `reasoning`."""
    match = _THINK.match(completion.text)
    if match is None:
        return completion
    return Completion(
        text=match["answer"].strip(),
        num_tokens=completion.num_tokens,
        finish_reason=completion.finish_reason,
        reasoning=match["reasoning"].strip(),
    )


class HFEngine:
    """`TargetEngine` on the in-process HF target: batched, left-padded `generate`.

    `SamplingParams.extra_body` entries become chat-template keyword arguments (`enable_thinking`...). A
    template that never mentions a key would silently ignore it, so a key it does not read is an error
    unless its value is falsy (switching off what the template lacks changes nothing).
    """

    def __init__(self, target: TargetConfig, *, batch_size: int = 16) -> None:
        if batch_size <= 0:
            raise ValueError(f"HFEngine: batch_size must be positive, got {batch_size}")
        self.target = target
        self.batch_size = batch_size
        self.model, self.tok = load_target(target)

    def describe(self) -> dict[str, str]:
        return {
            "engine": "hf",
            "model": self.target.name,
            "source": self.target.source,
            "chat_template_sha256": template_hash(self.tok.chat_template),
        }

    def template_kwargs(self, extra_body: dict[str, Any]) -> dict[str, Any]:
        """The `extra_body` entries the chat template reads; raises for a truthy one it never reads."""
        template = self.tok.chat_template or ""
        used = {k: v for k, v in extra_body.items() if re.search(rf"\b{re.escape(k)}\b", template)}
        unread = sorted(k for k, v in extra_body.items() if k not in used and v)
        if unread:
            raise ValueError(
                f"regenerate.extra_body: the chat template of {self.target.name} never reads {unread}; "
                "it would ignore them (thinking: the template has no enable_thinking switch)"
            )
        return used

    @torch.inference_mode()
    def chat(self, requests: Sequence[ChatRequest], params: SamplingParams) -> list[list[Completion]]:
        """`params.n` completions per request, generated `batch_size` requests at a time."""
        kwargs = self.template_kwargs(params.extra_body)
        if params.seed is not None:
            torch.manual_seed(params.seed)
        out: list[list[Completion]] = []
        for start in range(0, len(requests), self.batch_size):
            batch = requests[start : start + self.batch_size]
            texts = [
                _text(
                    self.tok.apply_chat_template(
                        r.messages,
                        tools=r.tools,  # type: ignore[arg-type]  # transformers: an invariant list of dict | Callable
                        add_generation_prompt=True,
                        tokenize=False,
                        **kwargs,
                    )
                )
                for r in batch
            ]
            outs = generate_texts(
                self.model,
                self.tok,
                texts,
                max_new_tokens=params.max_tokens,
                temperature=params.temperature,
                top_p=params.top_p,
                n=params.n,
            )
            out.extend([split_reasoning(c) for c in row] for row in outs)
        return out

    def close(self) -> None:
        """Nothing to release: the weights stay in `load_target`'s per-process cache for later stages."""


def _tap_module(layers: nn.ModuleList, k: int, tap_point: str) -> tuple[nn.Module, bool]:
    """Where tap k is read: the output of layer k, or the input of layer k + 1's pre-norm.

    In a plain pre-norm residual decoder the two are the same tensor. In a target whose layers do not read
    a running residual sum (Kimi K3's attention residuals mix earlier layer outputs with a learned softmax
    before each pre-norm), only `next_layer_input` is what the target itself computes with.
    """
    if tap_point == "layer_output":
        return layers[k - 1], False
    if tap_point != "next_layer_input":
        raise ValueError(f"hidden_states.tap_point: expected 'layer_output' or 'next_layer_input', got {tap_point!r}")
    consumer = layers[k]
    norm = getattr(consumer, "input_layernorm", None)
    if norm is None:
        raise ValueError(
            f"hidden_states.tap_point: next_layer_input needs `input_layernorm` on decoder layer {k} "
            f"({type(consumer).__name__} has none)"
        )
    return norm, True


class TapRecorder:
    """Forward hooks that keep the taps and the last hidden state of the most recent forward.

    Use as a context manager around any forward of the model (with or without a KV cache). Taps follow
    `engines.taps` (tap k = output of decoder layer k counting from 1) and are validated against the layer count.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        taps: Sequence[int],
        last_hidden: str = "post_norm",
        tap_point: str = "layer_output",
    ) -> None:
        _, layers, norm = decoder_parts(model)
        if last_hidden not in ("post_norm", "pre_norm"):
            raise ValueError(f"hidden_states.last_hidden: expected 'post_norm' or 'pre_norm', got {last_hidden!r}")
        self.taps = validate_taps(taps, len(layers))
        # name -> (module, True for a pre-hook on its input, False for a hook on its output)
        self._modules: dict[str, tuple[nn.Module, bool]] = {}
        for k in self.taps:
            self._modules[f"tap{k}"] = _tap_module(layers, k, tap_point)
        self._modules["last"] = (norm if last_hidden == "post_norm" else layers[len(layers) - 1], False)
        self._captured: dict[str, torch.Tensor] = {}
        self._handles: list = []

    def __enter__(self) -> "TapRecorder":
        for name, (module, on_input) in self._modules.items():
            if on_input:
                self._handles.append(module.register_forward_pre_hook(self._keep_input(name)))
            else:
                self._handles.append(module.register_forward_hook(self._keep(name)))
        return self

    def _keep_input(self, name: str) -> Callable[..., None]:
        def hook(_module: nn.Module, args: tuple) -> None:
            self._captured[name] = args[0]

        return hook

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _keep(self, name: str) -> Callable[..., None]:
        def hook(_module: nn.Module, _args: object, output: torch.Tensor | tuple) -> None:
            self._captured[name] = output[0] if isinstance(output, tuple) else output

        return hook

    def taps_BSNH(self) -> torch.Tensor:
        """`[B, S, N, H]` taps of the last forward."""
        return torch.stack([self._captured[f"tap{k}"] for k in self.taps], dim=2)

    def features_BSF(self) -> torch.Tensor:
        """`[B, S, N*H]`: taps concatenated in tap order (the drafters' fc input layout)."""
        return self.taps_BSNH().flatten(2)

    def last_BSH(self) -> torch.Tensor:
        return self._captured["last"]


@torch.inference_mode()
def forward_with_taps(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    taps: Sequence[int],
    *,
    last_hidden: str = "post_norm",
    chunk_tokens: int | None = None,
    tap_point: str = "layer_output",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the decoder (never the lm_head) and capture the residual stream at the taps.

    Tap k is the output of decoder layer k counting from 1, i.e. HF `hidden_states[k]` (`tap_point`
    `layer_output`), or what layer k + 1's input norm reads (`next_layer_input`, see `_tap_module`). The last
    hidden state is the final norm's output (`post_norm`) or the last layer's output (`pre_norm`).

    When `B * S` exceeds `chunk_tokens`, the sequence is prefilled in chunks of `chunk_tokens // B` positions
    through a KV cache (`forward_with_taps_chunked`), so activations stay at `chunk_tokens` tokens; otherwise
    one forward without a cache, which is bitwise equal to a manual layer-by-layer forward.

    Args:
        input_ids: `[B, S]` token ids, right-padded.
        attention_mask: `[B, S]`, 1 on real tokens.
        chunk_tokens: token budget of one forward; None for a single forward whatever the length.

    Returns:
        `taps_BSNH` `[B, S, N, H]` and `last_BSH` `[B, S, H]`, in the model's compute dtype.
    """
    if chunk_tokens is not None and input_ids.numel() > chunk_tokens:
        return forward_with_taps_chunked(
            model,
            input_ids,
            attention_mask,
            taps,
            last_hidden=last_hidden,
            chunk_tokens=chunk_tokens,
            tap_point=tap_point,
        )
    base, _, _ = decoder_parts(model)
    with TapRecorder(model, taps, last_hidden, tap_point) as rec:
        base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return rec.taps_BSNH(), rec.last_BSH()


@torch.inference_mode()
def forward_with_taps_chunked(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    taps: Sequence[int],
    *,
    last_hidden: str = "post_norm",
    chunk_tokens: int,
    tap_point: str = "layer_output",
) -> tuple[torch.Tensor, torch.Tensor]:
    """`forward_with_taps` as a chunked prefill: `chunk_tokens // B` positions per forward, through a KV cache.

    Each forward's activations are `[B, chunk, *]` (and its attention `chunk x past`), so their size is bounded
    by the budget; the KV cache (`2 * L * B * S * kv_width`) and the returned taps grow with `S`, as they must.
    Right padding keeps every query row with at least one real key, and positions are `0..S-1` as in one forward.
    Results equal the single forward up to fp32 rounding, not bitwise: attention over a cache reduces in a
    different blocking order than one full-sequence attention.

    Returns:
        `taps_BSNH` `[B, S, N, H]` and `last_BSH` `[B, S, H]`, in the model's compute dtype.
    """
    if chunk_tokens <= 0:
        raise ValueError(f"hidden_states.batch_tokens: the chunk token budget must be positive, got {chunk_tokens}")
    base, _, _ = decoder_parts(model)
    batch, seq = input_ids.shape
    step = max(1, chunk_tokens // batch)
    cache = DynamicCache(config=model.config)
    taps_parts: list[torch.Tensor] = []
    last_parts: list[torch.Tensor] = []
    with TapRecorder(model, taps, last_hidden, tap_point) as rec:
        for start in range(0, seq, step):
            end = min(seq, start + step)
            base(input_ids=input_ids[:, start:end], attention_mask=attention_mask[:, :end], cache=cache, use_cache=True)
            taps_parts.append(rec.taps_BSNH())
            last_parts.append(rec.last_BSH())
    return torch.cat(taps_parts, dim=1), torch.cat(last_parts, dim=1)
