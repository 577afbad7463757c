"""Capture engines for the hidden-state stage: token samples in, `HiddenSample`s out, in input order.

Both engines follow `draftsmith.engines.taps` (tap k = output of decoder layer k counting from 1) and the recipe's
capture points; the offline store and the Mooncake producer take their samples from here alike.
Shape legend: S sequence, N taps, H target width.
"""

from collections.abc import Iterable, Iterator
from typing import Protocol

import torch

from draftsmith.core import target_setup
from draftsmith.core.batching import group_by_length
from draftsmith.core.config import HiddenStatesConfig, TargetConfig
from draftsmith.engines import hf
from draftsmith.transport.sample import HiddenSample


class HiddenCapture(Protocol):
    def capture(self, samples: list[dict]) -> list[HiddenSample]:
        """`samples`: `{id, input_ids [S] int64, loss_mask [S] bool}` dicts (the tokenize stage's rows)."""
        ...

    def close(self) -> None: ...


def _sample(s: dict, taps_SNH: torch.Tensor, last_SH: torch.Tensor) -> HiddenSample:
    return HiddenSample(
        id=s["id"],
        input_ids=s["input_ids"],
        loss_mask=s["loss_mask"],
        hidden_states=taps_SNH.flatten(1),
        last_hidden=last_SH,
    )


class HFCapture:
    """transformers forward with hooks; right-padded batches under the `batch_tokens` budget."""

    def __init__(self, cfg: HiddenStatesConfig, target: TargetConfig):
        self.cfg = cfg
        self.model, tok = hf.load_target(target)
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0

    def capture(self, samples: list[dict]) -> list[HiddenSample]:
        """Samples are batched so that `batch * longest <= batch_tokens`; a longer one runs alone as a chunked
        prefill of `batch_tokens` positions per forward, so activation memory stays bounded whatever the length.
        Captured in the model's compute dtype (fp32 on CPU); the codec reduces it when encoding."""
        cfg = self.cfg
        out: list[HiddenSample | None] = [None] * len(samples)
        for batch in group_by_length([len(s["input_ids"]) for s in samples], cfg.batch_tokens):
            width = len(samples[batch[0]]["input_ids"])
            ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, i in enumerate(batch):
                n = len(samples[i]["input_ids"])
                ids[row, :n] = samples[i]["input_ids"]
                mask[row, :n] = 1
            taps_BSNH, last_BSH = hf.forward_with_taps(
                self.model,
                ids,
                mask,
                cfg.taps,
                last_hidden=cfg.last_hidden,
                chunk_tokens=cfg.batch_tokens,
                tap_point=cfg.tap_point,
            )
            for row, i in enumerate(batch):
                n = len(samples[i]["input_ids"])
                out[i] = _sample(samples[i], taps_BSNH[row, :n], last_BSH[row, :n])  # views: encode copies
        return [o for o in out if o is not None]

    def close(self) -> None:
        """The weights stay in `hf.load_target`'s per-process cache for later stages."""


class VLLMCapture:
    """vLLM's `extract_hidden_states` (in-process on GPU images, else a worker in `.venv-vllm`)."""

    def __init__(self, cfg: HiddenStatesConfig, target: TargetConfig, *, seed: int = 0):
        from draftsmith.engines.vllm_hidden import VLLMHiddenStates

        folder = target_setup.resolve_target(target.source)
        kwargs = dict(cfg.vllm.engine_kwargs)
        if target.trust_remote_code:
            kwargs.setdefault("trust_remote_code", True)
        kwargs.setdefault("dtype", target.compute_dtype)
        self.engine = VLLMHiddenStates(
            folder,
            cfg.taps,
            last_hidden=cfg.last_hidden,
            max_model_len=cfg.vllm.max_model_len,
            seed=seed,
            python=cfg.vllm.python,
            engine_kwargs=kwargs,
        )
        self.batch_tokens = cfg.batch_tokens

    def capture(self, samples: list[dict]) -> list[HiddenSample]:
        out: list[HiddenSample | None] = [None] * len(samples)
        for batch in group_by_length([len(s["input_ids"]) for s in samples], self.batch_tokens):
            got = self.engine.capture([samples[i]["input_ids"].tolist() for i in batch])
            for i, (taps_SNH, last_SH) in zip(batch, got, strict=True):
                out[i] = _sample(samples[i], taps_SNH, last_SH)
        return [o for o in out if o is not None]

    def close(self) -> None:
        self.engine.close()


def make_capture(cfg: HiddenStatesConfig, target: TargetConfig) -> HiddenCapture:
    if cfg.engine == "vllm":
        return VLLMCapture(cfg, target)
    return HFCapture(cfg, target)


def capture_stream(
    engine: HiddenCapture, samples: Iterable[dict], window_tokens: int, *, boundary: int | None = None
) -> Iterator[HiddenSample]:
    """Captured samples in input order, one engine call per window of about `window_tokens` tokens.

    The window bounds what is held in the compute dtype at once (the callers encode each sample as it
    comes); within it the engine groups samples by length, so a wider window pads less. With `boundary`, a
    window also ends after every `boundary` samples of the stream: a capture resumed at such a point (the
    store's committed shards) then forms the same forward batches as an uninterrupted one, and since
    kernels round differently with the batch shape, only that makes the resumed values the same bytes.
    """
    if boundary is not None and boundary <= 0:
        raise ValueError(f"boundary {boundary}: expected a positive number of samples")
    buf: list[dict] = []
    tokens = 0
    for n, s in enumerate(samples, start=1):
        buf.append(s)
        tokens += len(s["input_ids"])
        if tokens >= window_tokens or (boundary is not None and n % boundary == 0):
            yield from engine.capture(buf)
            buf, tokens = [], 0
    if buf:
        yield from engine.capture(buf)
