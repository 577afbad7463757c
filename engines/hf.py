"""The in-process Hugging Face target engine: the embedded default on CPU.

Shape legend: B batch, S sequence, H target hidden size, N number of taps, V target vocabulary.
"""

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from draftsmith.config import TargetConfig
from draftsmith.target_setup import resolve_target

log = logging.getLogger(__name__)

Message = dict[str, str]


@dataclass(frozen=True)
class Completion:
    """One generated assistant turn."""

    text: str
    num_tokens: int
    finished: bool  # ended on an end-of-turn token rather than the length limit


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


def decoder_parts(model: PreTrainedModel) -> tuple[nn.Module, nn.ModuleList, nn.Module]:
    """The base decoder, its layer list and its final norm (Llama-style models)."""
    base = model.get_decoder()
    return base, base.layers, base.norm


def end_of_turn_ids(tok: PreTrainedTokenizerBase, model: PreTrainedModel) -> list[int]:
    ids = model.generation_config.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tok.eos_token_id is not None and tok.eos_token_id not in ids:
        ids.append(tok.eos_token_id)
    return ids


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
    texts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in conversations]
    enc = tok(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    eos = end_of_turn_ids(tok, model)
    sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p} if temperature > 0 else {}
    out = model.generate(
        **enc,
        max_new_tokens=max_new_tokens,
        pad_token_id=tok.pad_token_id,
        eos_token_id=eos,
        do_sample=temperature > 0,
        **sampling,
    )
    completions = []
    for row in out[:, enc["input_ids"].shape[1] :].tolist():
        stop = next((i for i, t in enumerate(row) if t in eos), None)
        body = row if stop is None else row[:stop]
        text = tok.decode(body, skip_special_tokens=True).strip()
        completions.append(Completion(text=text, num_tokens=len(body), finished=stop is not None))
    return completions


class TapRecorder:
    """Forward hooks that keep the taps and the last hidden state of the most recent forward.

    Use as a context manager around any forward of the model (with or without a KV cache).
    """

    def __init__(self, model: PreTrainedModel, taps: Sequence[int], last_hidden: str = "post_norm") -> None:
        _, layers, norm = decoder_parts(model)
        for k in taps:
            if not 1 <= k < len(layers):
                raise ValueError(f"tap {k} is outside 1..{len(layers) - 1} for a {len(layers)}-layer target")
        self.taps = list(taps)
        self._modules = {f"tap{k}": layers[k - 1] for k in taps}
        self._modules["last"] = norm if last_hidden == "post_norm" else layers[len(layers) - 1]
        self._captured: dict[str, torch.Tensor] = {}
        self._handles: list = []

    def __enter__(self) -> "TapRecorder":
        for name, module in self._modules.items():
            self._handles.append(module.register_forward_hook(self._keep(name)))
        return self

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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the decoder (never the lm_head) and capture the residual stream at the taps.

    Tap k is the output of decoder layer k counting from 1, i.e. HF `hidden_states[k]`. The last
    hidden state is the final norm's output (`post_norm`) or the last layer's output (`pre_norm`).

    Args:
        input_ids: `[B, S]` token ids, right-padded.
        attention_mask: `[B, S]`, 1 on real tokens.

    Returns:
        `taps_BSNH` `[B, S, N, H]` and `last_BSH` `[B, S, H]`, in the model's compute dtype.
    """
    base, _, _ = decoder_parts(model)
    with TapRecorder(model, taps, last_hidden) as rec:
        base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return rec.taps_BSNH(), rec.last_BSH()
