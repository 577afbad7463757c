"""Tensors the drafters make for themselves live on the device of the tensors they meet.

A tensor made without `device=` lands on the CPU; on a GPU it then meets CUDA tensors and the step fails
("Expected all tensors to be on the same device"). A meta tensor is just as strict about meeting a CPU
tensor and needs no GPU, so every path here runs on meta inputs and modules moved to meta: a CPU-made
tensor anywhere in it raises, and every output must be on meta. Modules are built on the CPU and then
moved, never built under `torch.device("meta")`, which would send the code's own device-less factory
calls to meta too and hide exactly the bugs looked for.

Meta tensors hold no data, so what needs values cannot run here: anchor sampling (its candidate search is
host work by design, `drafters.anchors`), the objectives' `nonzero` over valid slots, boolean-mask
indexing, `bincount`/`unique`, `.item()`. The objectives are therefore covered piece by piece: every
model forward they call, the label, mask, vocabulary and RoPE helpers, and the per-slot reductions.

Shape legend: B batch, S sequence, N anchors, K block slots.
"""

from typing import Any

import pytest
import torch

from draftsmith.core.config import Eagle3Config
from draftsmith.drafters import confidence, vocab
from draftsmith.drafters.dflash import DFlashDrafter, DFlashSpec
from draftsmith.drafters.dflash import decode as block_decode
from draftsmith.drafters.dflash.loss import _slot_stats, _to_output_vocab, slot_ce, slot_labels, slot_weights
from draftsmith.drafters.dflash.selector import walk
from draftsmith.drafters.dspark.decode import _over_target
from draftsmith.drafters.dspark.loss import outside_logsumexp
from draftsmith.drafters.dspark.model import DSparkDrafter, DSparkSpec, output_labels
from draftsmith.drafters.eagle3 import anchored, decode, family, loss
from draftsmith.drafters.eagle3.model import Eagle3Drafter, Eagle3Spec
from draftsmith.drafters.layers import RopeScaling, rope_tables
from draftsmith.drafters.mla import MLASpec, MLAttention
from draftsmith.drafters.verify import Sampling

pytestmark = pytest.mark.unit

META = torch.device("meta")
MLA: dict[str, Any] = {
    "kv_lora_rank": 16,
    "q_lora_rank": 12,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 8,
}
YARN = {
    "rope_type": "yarn",
    "factor": 8.0,
    "original_max_position_embeddings": 64,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
B, S, N, V, VD, HT, TAPS = 2, 12, 3, 60, 20, 24, 3


def _on_meta(*tensors: torch.Tensor) -> None:
    for t in tensors:
        assert t.device.type == "meta", f"a tensor came back on {t.device}"


def _ids(high: int = V, shape=(B, S)) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.long, device=META).clamp(max=high - 1)


def _anchors() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(B, N, dtype=torch.long, device=META), torch.ones(B, N, dtype=torch.bool, device=META)


def test_vocabulary_helpers():
    counts = torch.ones(V, dtype=torch.long, device=META)
    d2t, t2d = vocab.build_draft_vocab(counts, VD)
    _on_meta(d2t, t2d, vocab.draft_ids(d2t), vocab.target_to_draft(t2d))


def test_target_to_draft_is_the_rank_among_draft_ids():
    """The sync-free form equals the boolean assignment it replaced, bit for bit."""
    t2d = torch.rand(V, generator=torch.Generator().manual_seed(0)) < 0.3
    expected = torch.full((V,), -1, dtype=torch.int64)
    expected[t2d] = torch.arange(int(t2d.sum()))
    got = vocab.target_to_draft(t2d)
    assert got.dtype == torch.int64 and torch.equal(got, expected)


@pytest.mark.parametrize("scaling", [None, YARN], ids=["default", "yarn"])
def test_rope_tables(scaling):
    positions = torch.zeros(B, S, dtype=torch.long, device=META)
    cos, sin = rope_tables(positions, 8, 10000.0, RopeScaling.from_config(scaling))
    _on_meta(cos, sin)
    assert cos.shape == sin.shape == (B, S, 8)


@pytest.mark.parametrize("scaling", [None, YARN], ids=["default", "yarn"])
def test_mla_attention(scaling):
    spec = MLASpec(hidden_size=32, num_heads=4, rope_scaling=scaling, **MLA)
    attn = MLAttention(spec).to(META)
    x = torch.zeros(B, S, 32, device=META)
    mask = torch.ones(B, 1, S, S, dtype=torch.bool, device=META)
    out = attn(x, torch.zeros(S, dtype=torch.long, device=META), mask)
    _on_meta(out)


def _eagle3(attention: str) -> Eagle3Drafter:
    spec = Eagle3Spec(
        hidden_size=32,
        target_hidden_size=HT,
        num_taps=TAPS,
        num_heads=4,
        num_kv_heads=2 if attention == "gqa" else 4,
        head_dim=8,
        intermediate_size=64,
        vocab_size=V,
        draft_vocab_size=VD,
        rope_theta=10000.0,
        rope_scaling=YARN,
        fc_norm=True,
        norm_output=True,
        attention=attention,
        mla=MLA if attention == "mla" else None,
    )
    return Eagle3Drafter(spec).to(META)


@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_eagle3_training_forwards(attention):
    """Dense and anchored TTT, and the objective's draft head rows (the first failure seen on a GPU)."""
    model = _eagle3(attention)
    feats = torch.zeros(B, S, TAPS * HT, device=META)
    _on_meta(*model.ttt_hidden(_ids(), feats, 3))
    anchors, keep = _anchors()
    _on_meta(*anchored.anchored_hidden(model, _ids(), feats, anchors, keep, 3))
    head = torch.zeros(V, HT, device=META)
    cfg = Eagle3Config(num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64, draft_vocab_size=VD)
    family.objective(cfg, model, head, torch.Generator(), shared=False)


def test_eagle3_loss_reductions():
    """Per-depth terms and their decayed total stay on the device, counts included (the trainer multiplies
    the per-slot losses by the counts)."""
    logits, target = torch.zeros(5, VD, device=META), torch.zeros(5, VD, device=META)
    term = loss.depth_term(logits, target)
    _on_meta(*term)
    out = loss.combine([term, term, term], 0.8)
    _on_meta(out.total, out.step_loss, out.step_acc, out.step_count)


@torch.no_grad()
def test_eagle3_decoding_helpers():
    model = _eagle3("gqa")
    cache = decode.DraftCache()
    tokens, hidden = torch.zeros(4, dtype=torch.long, device=META), torch.zeros(4, 32, device=META)
    _on_meta(*decode.draft_forward(model, tokens, hidden, 0, cache))
    _on_meta(*decode.draft_forward(model, tokens[:1], hidden[:1], 4, cache))
    _on_meta(decode._to_target_vocab(model, torch.zeros(VD, device=META)))


def _block_spec(cls: Any = DFlashSpec, **kw: Any) -> Any:
    base = dict(
        hidden_size=32,
        target_hidden_size=HT,
        num_taps=TAPS,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=64,
        vocab_size=V,
        block_size=4,
        mask_token_id=V - 1,
        rope_scaling=YARN,
        draft_vocab_size=VD,
        fc_norm=True,
    )
    return cls(**(base | kw))


DFLASH_VARIANTS: dict[str, dict[str, Any]] = {
    "gqa-pruned": {},
    "mla-pruned": dict(attention="mla", mla=MLA, num_kv_heads=4),
    # The selector needs the full vocabulary (vLLM's walk emits lm_head ids as target ids).
    "dflash2-conv-selector-sliding": dict(
        draft_vocab_size=None,
        conv_kernel_size=3,
        conv_group_size=8,
        selector_rank=4,
        selector_top_k=3,
        layer_types=("sliding_attention", "full_attention"),
        sliding_window=6,
    ),
}


@pytest.mark.parametrize("variant", list(DFLASH_VARIANTS))
def test_dflash_training_pieces(variant):
    model = DFlashDrafter(_block_spec(**DFLASH_VARIANTS[variant])).to(META)
    anchors, keep = _anchors()
    h = model.train_hidden(_ids(), torch.zeros(B, S, TAPS * HT, device=META), anchors, keep)
    labels, valid = slot_labels(_ids(), torch.ones(B, S, dtype=torch.bool, device=META), anchors, keep, 4, False)
    out_labels, out_valid = _to_output_vocab(labels, valid, getattr(model, "t2d", None))
    _on_meta(h, labels, valid, out_labels, out_valid)
    rows, slots = h.flatten(0, 2), torch.zeros(B * N * 4, dtype=torch.long, device=META)
    stats = slot_ce(model.logits(rows), torch.zeros_like(slots), slots, slot_weights(4, 4.0, False))
    _on_meta(stats.total, stats.step_loss, stats.step_acc, stats.step_count)
    if model.spec.selector_rank:
        cand = torch.zeros(1, 3, 3, dtype=torch.long, device=META)
        anchor = torch.zeros(1, dtype=torch.long, device=META)
        scores = model.candidate_selector.edge_scores(cand, torch.zeros(1, 3, 3, device=META), h[:1, 0, 1:], anchor)
        _on_meta(scores, walk(scores, cand))


def test_slot_stats():
    ce, slots = torch.zeros(6, device=META), torch.zeros(6, dtype=torch.long, device=META)
    stats = _slot_stats(ce.sum(), ce, ce, slots, 4)
    _on_meta(stats.step_loss, stats.step_acc, stats.step_count)


@torch.no_grad()
@pytest.mark.parametrize("variant", list(DFLASH_VARIANTS))
def test_block_decoding_helpers(variant):
    """A block over a growing context, its greedy drafts (the selector walk where there is one) and the sampled
    pick laid over the target vocabulary."""
    model = DFlashDrafter(_block_spec(**DFLASH_VARIANTS[variant])).to(META)
    ctx = block_decode.ContextKV(model)
    ctx.extend(torch.zeros(5, TAPS * HT, device=META))
    ctx.extend(torch.zeros(2, TAPS * HT, device=META))
    h = block_decode.draft_block_hidden(model, ctx, 3)
    anchor = torch.tensor(3, device=META)
    _on_meta(h, block_decode.default_pick(model, h, anchor, Sampling(), None).tokens)
    # No generator exists on meta; the default one is what `multinomial` falls back to.
    draft = block_decode.default_pick(model, h, anchor, Sampling(temperature=1.0), None)
    assert draft.q is not None
    _on_meta(draft.tokens, draft.q)


@pytest.mark.parametrize("draft_vocab_size", [VD, None])
def test_dspark_training_pieces(draft_vocab_size):
    spec = _block_spec(DSparkSpec, markov_rank=8, draft_vocab_size=draft_vocab_size)
    model = DSparkDrafter(spec).to(META)
    anchors, keep = _anchors()
    logits, conf, emb = model.train_outputs(_ids(), torch.zeros(B, S, TAPS * HT, device=META), anchors, keep)
    labels, valid = output_labels(model, _ids(), torch.ones(B, S, dtype=torch.bool, device=META))
    _on_meta(logits, conf, emb, labels, valid, model.prev_tokens(_ids(), anchors))
    if draft_vocab_size is not None:
        head = torch.zeros(V, HT, device=META)
        _on_meta(outside_logsumexp(torch.zeros(5, HT, device=META), head, model.t2d))
        _on_meta(_over_target(model, torch.zeros(VD, device=META)))


def test_calibrated_survival_of_device_logits():
    """A calibration's temperatures are host floats; the confidence logits come from the drafter's device."""
    got = confidence.survival(torch.zeros(4, device=META), torch.ones(4, dtype=torch.float64))
    _on_meta(got)
