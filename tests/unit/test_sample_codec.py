"""The sample wire format: exact bf16/fp32 round trips, fp8 e4m3 within its rounding bound, supervised rows."""

import pytest
import torch

from draftsmith.transport.sample import (
    FP8_MAX,
    HiddenSample,
    StoreCodec,
    decode,
    dequantize_fp8,
    encode,
    quantize_fp8,
    supervised_rows,
)

pytestmark = pytest.mark.unit


def _sample(seq: int = 11, taps: int = 3, width: int = 16, seed: int = 0) -> HiddenSample:
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(seq, dtype=torch.bool)
    mask[seq // 2 :] = True
    return HiddenSample(
        id=f"s{seed}",
        input_ids=torch.randint(0, 1000, (seq,), generator=g),
        loss_mask=mask,
        hidden_states=torch.randn(seq, taps * width, generator=g) * torch.logspace(-2, 2, seq)[:, None],
        last_hidden=torch.randn(seq, width, generator=g),
    )


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_bf16_and_fp32_round_trip_exactly(dtype):
    s = _sample()
    codec = StoreCodec(dtype=dtype, num_taps=3)
    out = decode(s.id, encode(s, codec), codec)
    want = getattr(torch, dtype)
    assert torch.equal(out.hidden_states, s.hidden_states.to(want))
    assert torch.equal(out.last_hidden, s.last_hidden.to(want))
    assert torch.equal(out.input_ids, s.input_ids) and torch.equal(out.loss_mask, s.loss_mask)


def test_fp8_error_is_within_e4m3_rounding_per_row_and_tap():
    s = _sample()
    codec = StoreCodec(dtype="fp8_e4m3", num_taps=3)
    wire = encode(s, codec)
    assert wire["hidden_states"].dtype == torch.float8_e4m3fn and wire["hidden_scales"].shape == (11, 3)
    out = decode(s.id, wire, codec).hidden_states
    # Each row and tap has its own scale (rows span four decades here): e4m3 keeps 3 mantissa bits, so a
    # normal value rounds within 2**-4 relative; values below the smallest normal within half a subnormal step.
    scale = wire["hidden_scales"].repeat_interleave(16, dim=1)
    bound = s.hidden_states.abs() * 2**-4 + scale * 2**-10
    assert ((out - s.hidden_states).abs() <= bound).all()
    assert (s.hidden_states.reshape(11, 3, 16).abs().amax(-1) / wire["hidden_scales"] - FP8_MAX).abs().max() < 1e-3


def test_fp8_zero_rows_and_shapes():
    q, scale = quantize_fp8(torch.zeros(2, 8), 2)
    assert torch.equal(dequantize_fp8(q, scale), torch.zeros(2, 8))
    with pytest.raises(ValueError, match="num_taps=5"):
        encode(_sample(taps=3), StoreCodec(num_taps=5))


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8_e4m3"])
def test_supervised_keeps_last_hidden_only_where_a_loss_reads_it(dtype):
    s = _sample()
    codec = StoreCodec(dtype=dtype, positions="supervised", num_taps=3)
    wire = encode(s, codec)
    rows = supervised_rows(s.loss_mask)
    assert rows.tolist() == s.loss_mask[1:].tolist() + [False]
    assert wire["last_hidden"].shape[0] == int(rows.sum()) < len(s.input_ids)
    assert wire["hidden_states"].shape[0] == len(s.input_ids)  # taps stay: they are attention context
    out = decode(s.id, wire, codec)
    full = decode(s.id, encode(s, StoreCodec(dtype=dtype, num_taps=3)), StoreCodec(dtype=dtype, num_taps=3))
    assert torch.equal(out.last_hidden[rows], full.last_hidden[rows])
    assert not out.last_hidden[~rows].any()
    wire["last_hidden"] = wire["last_hidden"][1:]
    with pytest.raises(ValueError, match="s0: .* supervises"):
        decode(s.id, wire, codec)
