"""One captured sample and its wire form: the contract between capture, the offline store and Mooncake.

A sample travels as a flat dict of named tensors (`encode`) and comes back as a `HiddenSample` (`decode`).
The offline store concatenates many samples' wire tensors into one safetensors shard; the Mooncake stream
puts each wire tensor under its own key. Both decode with the same function, so the trainer cannot tell
where a sample came from.

Codecs (`StoreCodec`):

- `dtype`: `bfloat16` (the default), `float32`, or `fp8_e4m3`: float8 e4m3 values with one fp32 scale per
  row and tap (`hidden_scales` `[S, N]`, `last_scales` `[L, 1]`), scale = row amax / 448.
- `positions`: `all`, or `supervised`: `last_hidden` is kept only at rows p whose next token p + 1 is a
  loss token, because every drafter (EAGLE-3 TTT, anchored EAGLE, DFlash, DSpark) reads the target's
  distribution only there. Taps stay at every position: they are the context keys/values that every later
  position attends to, in all of those drafters. `decode` scatters the kept rows back into `[S, H]` zeros.

Shape legend: S sequence, N taps, H target width, L supervised rows.
"""

from dataclasses import dataclass
from typing import Literal

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8 = torch.float8_e4m3fn
Dtype = Literal["bfloat16", "float32", "fp8_e4m3"]
Positions = Literal["all", "supervised"]

# Wire tensors whose first dimension is the sequence (or supervised-row) axis; everything a sample has.
SEQ_TENSORS = ("input_ids", "loss_mask", "hidden_states", "hidden_scales")
LAST_TENSORS = ("last_hidden", "last_scales")


@dataclass
class HiddenSample:
    """`input_ids` `[S]` int64, `loss_mask` `[S]` bool, `hidden_states` `[S, N*H]`, `last_hidden` `[S, H]`.

    `hidden_states` holds the taps concatenated in tap order. `in_draft` `[S]` bool is filled by the trainer
    (is the target's argmax at p in the draft vocabulary).
    """

    id: str
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    hidden_states: torch.Tensor
    last_hidden: torch.Tensor
    in_draft: torch.Tensor | None = None

    @property
    def features(self) -> torch.Tensor:
        """The fused-tap input of an EAGLE-3 drafter, `[S, N*H]` (an alias of `hidden_states`)."""
        return self.hidden_states


@dataclass(frozen=True)
class StoreCodec:
    """How a sample's hidden states are reduced on the wire."""

    dtype: Dtype = "bfloat16"
    positions: Positions = "all"
    num_taps: int = 1

    def tap_bytes_per_token(self, hidden_size: int) -> float:
        """Bytes one token's taps take, scales included."""
        if self.dtype == "fp8_e4m3":
            return self.num_taps * (hidden_size + 4)
        return self.num_taps * hidden_size * (4 if self.dtype == "float32" else 2)

    def last_bytes_per_row(self, hidden_size: int) -> float:
        if self.dtype == "fp8_e4m3":
            return hidden_size + 4
        return hidden_size * (4 if self.dtype == "float32" else 2)


def supervised_rows(loss_mask_S: torch.Tensor) -> torch.Tensor:
    """`[S]` bool: row p is read by a drafter loss iff token p + 1 is a loss token."""
    rows = torch.zeros_like(loss_mask_S, dtype=torch.bool)
    rows[:-1] = loss_mask_S[1:].bool()
    return rows


def quantize_fp8(x_RC: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split each row into `groups` equal groups; fp8 values `[R, C]` and fp32 scales `[R, groups]`."""
    rows = x_RC.shape[0]
    g = x_RC.float().reshape(rows, groups, -1)
    scale = (g.abs().amax(-1) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    q = (g / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.reshape(rows, -1), scale


def dequantize_fp8(q_RC: torch.Tensor, scale_RG: torch.Tensor) -> torch.Tensor:
    """fp32 `[R, C]` from fp8 values and per-group scales."""
    rows, groups = scale_RG.shape
    return (q_RC.float().reshape(rows, groups, -1) * scale_RG.unsqueeze(-1)).reshape(rows, -1)


def _pack(x: torch.Tensor, codec: StoreCodec, groups: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    if codec.dtype == "fp8_e4m3":
        return quantize_fp8(x, groups)
    return x.to(getattr(torch, codec.dtype)).contiguous(), None


def encode(sample: HiddenSample, codec: StoreCodec) -> dict[str, torch.Tensor]:
    """The wire tensors of one sample (see the module docstring); `input_ids` int32, `loss_mask` uint8."""
    if sample.hidden_states.shape[-1] % codec.num_taps:
        raise ValueError(
            f"sample {sample.id}: hidden_states width {sample.hidden_states.shape[-1]} is not a multiple of "
            f"num_taps={codec.num_taps}"
        )
    out = {
        "input_ids": sample.input_ids.to(torch.int32).contiguous(),
        "loss_mask": sample.loss_mask.to(torch.uint8).contiguous(),
    }
    hidden, hidden_scales = _pack(sample.hidden_states, codec, codec.num_taps)
    out["hidden_states"] = hidden
    if hidden_scales is not None:
        out["hidden_scales"] = hidden_scales
    last = sample.last_hidden
    if codec.positions == "supervised":
        last = last[supervised_rows(sample.loss_mask)]
    last, last_scales = _pack(last, codec, 1)
    out["last_hidden"] = last
    if last_scales is not None:
        out["last_scales"] = last_scales
    return out


def decode(sid: str, wire: dict[str, torch.Tensor], codec: StoreCodec) -> HiddenSample:
    """A `HiddenSample` from its wire tensors. fp8 is dequantized to fp32; bf16/fp32 stay as stored."""
    loss_mask = wire["loss_mask"].bool()
    last = wire["last_hidden"]
    rows = supervised_rows(loss_mask) if codec.positions == "supervised" else None
    expected = len(loss_mask) if rows is None else int(rows.sum())
    if last.shape[0] != expected:
        what = "the loss mask supervises" if rows is not None else "the sample has"
        raise ValueError(f"sample {sid}: {last.shape[0]} stored last_hidden rows but {what} {expected}")
    hidden = wire["hidden_states"]
    if codec.dtype == "fp8_e4m3":
        for name, values in (("hidden_scales", hidden), ("last_scales", last)):
            if wire[name].shape[0] != values.shape[0]:
                raise ValueError(f"sample {sid}: {name} has {wire[name].shape[0]} rows for {values.shape[0]}")
        hidden = dequantize_fp8(hidden, wire["hidden_scales"])
        last = dequantize_fp8(last, wire["last_scales"])
    if rows is not None:
        full = torch.zeros(len(loss_mask), last.shape[-1], dtype=last.dtype)
        full[rows] = last
        last = full
    return HiddenSample(
        id=sid, input_ids=wire["input_ids"].long(), loss_mask=loss_mask, hidden_states=hidden, last_hidden=last
    )
