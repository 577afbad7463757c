"""Hidden-state capture is exact: bitwise equal to a hand-run forward in fp32, and bounded in memory when chunked."""

import contextlib

import pytest
import torch

from draftsmith.core.batching import group_by_length
from draftsmith.engines import hf
from draftsmith.engines.hidden_capture import HFCapture

pytestmark = pytest.mark.integration

# Chunked prefill attends over a KV cache: the same sums in a different blocking order, so fp32 results differ
# by a few ulps (measured ~2e-6 on values up to ~4 on the tiny target), never bitwise. 1e-5 is ~20 ulps there.
CHUNKED_FP32_TOL = 1e-5
LENGTHS = [37, 20, 5]


def _right_padded(lengths: list[int], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 49152, (len(lengths), max(lengths)), generator=gen)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    return ids.masked_fill(mask == 0, pad_id), mask


@torch.inference_mode()
def _manual_forward(model, ids: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """[embedding, layer 1 .. layer L outputs, final norm], each `[B, S, H]`, one decoder layer at a time."""
    base, layers, norm = hf.decoder_parts(model)  # a Llama-style decoder: called by its attribute names
    seq = ids.shape[1]
    x = base.embed_tokens(ids)
    pos = torch.arange(seq)[None]
    rope = base.rotary_emb(x, position_ids=pos)
    # Causal and key-not-padding; True means attend.
    attend = torch.ones(seq, seq, dtype=torch.bool).tril()[None, None] & mask.bool()[:, None, None, :]
    outs = [x]
    for layer in layers:
        x = layer(x, attention_mask=attend, position_embeddings=rope, position_ids=pos)
        outs.append(x)
    return [*outs, norm(x)]


@contextlib.contextmanager
def _largest_output(model):
    """Track the largest tensor (in elements) any submodule of the model outputs."""
    seen = {"numel": 0}

    def hook(_m, _a, out):
        for t in out if isinstance(out, tuple) else (out,):
            if isinstance(t, torch.Tensor):
                seen["numel"] = max(seen["numel"], t.numel())

    handles = [m.register_forward_hook(hook) for m in model.modules()]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def test_taps_equal_manual_forward_and_hf_hidden_states_bitwise(tiny_cfg, tiny_target):
    model, tok = tiny_target
    assert model.dtype == torch.float32
    taps_cfg = tiny_cfg.hidden_states.taps
    ids, mask = _right_padded(LENGTHS, tok.pad_token_id)
    for last_hidden, last_index in (("post_norm", -1), ("pre_norm", -2)):
        taps_BSNH, last_BSH = hf.forward_with_taps(model, ids, mask, taps_cfg, last_hidden=last_hidden)
        manual = _manual_forward(model, ids, mask)
        for row, n in enumerate(LENGTHS):
            for i, k in enumerate(taps_cfg):
                assert torch.equal(taps_BSNH[row, :n, i], manual[k][row, :n]), (last_hidden, row, k)
            assert torch.equal(last_BSH[row, :n], manual[last_index][row, :n]), (last_hidden, row)
    with torch.inference_mode():
        ref = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    taps_BSNH, last_BSH = hf.forward_with_taps(model, ids, mask, taps_cfg)
    assert len(ref) == model.config.num_hidden_layers + 1
    for i, k in enumerate(taps_cfg):
        assert torch.equal(taps_BSNH[:, :, i], ref[k])
    assert torch.equal(last_BSH, ref[-1])  # HF's last entry is post-norm


def test_capture_samples_equals_manual_forward_and_bounds_long_samples(tiny_cfg, tiny_target):
    model, tok = tiny_target
    budget = 32
    cfg = tiny_cfg.hidden_states.model_copy(update={"batch_tokens": budget, "store_dtype": "float32"})
    lengths = [9, 90, 14, 7, 16]  # 90 > budget: chunked; the rest share right-padded batches
    ids, mask = _right_padded(lengths, tok.pad_token_id)
    samples = [
        {"id": str(row), "input_ids": ids[row, :n], "loss_mask": torch.ones(n, dtype=torch.bool)}
        for row, n in enumerate(lengths)
    ]
    engine = HFCapture(cfg, tiny_cfg.target)
    assert engine.model is model  # the per-process cache: the hooks below watch the engine's model
    with _largest_output(model) as seen:
        captured = [(s.hidden_states, s.last_hidden) for s in engine.capture(samples)]
    width = max(model.config.intermediate_size, model.config.hidden_size)
    assert seen["numel"] <= budget * width  # no activation beyond the token budget
    for batch in group_by_length(lengths, budget):
        # The reference is the same right-padded batch the engine forms, run by hand.
        width = lengths[batch[0]]
        b_ids, b_mask = ids[batch, :width], mask[batch, :width]
        manual = _manual_forward(model, b_ids, b_mask)
        for row, i in enumerate(batch):
            n, (feats, last) = lengths[i], captured[i]
            want = torch.cat([manual[k][row, :n] for k in cfg.taps], dim=-1)
            if width <= budget:
                assert torch.equal(feats, want) and torch.equal(last, manual[-1][row, :n]), i
            else:
                # Chunked (the activation bound above proves it): equal within the fp32 tolerance.
                torch.testing.assert_close(feats, want, rtol=CHUNKED_FP32_TOL, atol=CHUNKED_FP32_TOL)
                torch.testing.assert_close(last, manual[-1][row, :n], rtol=CHUNKED_FP32_TOL, atol=CHUNKED_FP32_TOL)


@pytest.mark.parametrize("chunk_tokens", [6, 16, 33])
def test_chunked_prefill_matches_one_shot_with_bounded_activations(tiny_cfg, tiny_target, chunk_tokens):
    model, tok = tiny_target
    taps_cfg = tiny_cfg.hidden_states.taps
    ids, mask = _right_padded(LENGTHS, tok.pad_token_id)
    with _largest_output(model) as one_shot:
        taps_ref, last_ref = hf.forward_with_taps(model, ids, mask, taps_cfg)
    with _largest_output(model) as chunked:
        taps_c, last_c = hf.forward_with_taps(model, ids, mask, taps_cfg, chunk_tokens=chunk_tokens)
    width = max(model.config.intermediate_size, model.config.hidden_size)
    assert chunked["numel"] <= chunk_tokens * width < one_shot["numel"]
    assert taps_c.shape == taps_ref.shape and last_c.shape == last_ref.shape
    for row, n in enumerate(LENGTHS):
        torch.testing.assert_close(taps_c[row, :n], taps_ref[row, :n], rtol=CHUNKED_FP32_TOL, atol=CHUNKED_FP32_TOL)
        torch.testing.assert_close(last_c[row, :n], last_ref[row, :n], rtol=CHUNKED_FP32_TOL, atol=CHUNKED_FP32_TOL)


def test_recorder_rejects_taps_outside_the_target(tiny_target):
    model, _ = tiny_target
    with pytest.raises(ValueError, match=r"^hidden_states\.taps\[1\] = 4: outside 1\.\.3 for a 4-layer target"):
        hf.TapRecorder(model, [1, 4])
    with pytest.raises(ValueError, match=r"^hidden_states\.last_hidden: expected"):
        hf.TapRecorder(model, [1], last_hidden="post-norm")


def test_next_layer_input_is_the_layer_output_in_a_residual_decoder(tiny_cfg, tiny_target):
    """The pre-hook on layer k+1's input norm reads the very tensor layer k returned (Kimi K3 differs)."""
    model, tok = tiny_target
    ids, mask = _right_padded(LENGTHS, tok.pad_token_id)
    taps = tiny_cfg.hidden_states.taps
    out = hf.forward_with_taps(model, ids, mask, taps)
    nxt = hf.forward_with_taps(model, ids, mask, taps, tap_point="next_layer_input")
    assert torch.equal(out[0], nxt[0]) and torch.equal(out[1], nxt[1])
    with pytest.raises(ValueError, match="hidden_states.tap_point: expected"):
        hf.forward_with_taps(model, ids, mask, taps, tap_point="attn_out")
