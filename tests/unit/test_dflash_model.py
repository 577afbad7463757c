"""The block drafter trains on exactly what it computes at inference: masks, conv and packed blocks."""

from typing import Any

import pytest
import torch

from draftsmith.drafters.dflash import DFlashDrafter, DFlashSpec
from draftsmith.drafters.dflash.block_masks import decode_mask, train_mask
from draftsmith.drafters.dflash.layers import DFlashMLA, GroupedConv
from draftsmith.drafters.dflash.loss import dflash_objective
from draftsmith.drafters.masks import dense, dflash_blocks
from draftsmith.drafters.mla import MLAProjection

pytestmark = pytest.mark.unit

MLA = {"kv_lora_rank": 16, "q_lora_rank": 12, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8}


def _spec(**kw) -> DFlashSpec:
    base = dict(
        hidden_size=32,
        target_hidden_size=24,
        num_taps=3,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=64,
        vocab_size=60,
        block_size=4,
        mask_token_id=59,
    )
    return DFlashSpec(**{**base, **kw})


def _random(model: DFlashDrafter) -> DFlashDrafter:
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model.eval()


def _ref_mask(anchors, keep, S, block, window, causal) -> torch.Tensor:
    """Loop reference of the rules in `block_masks`' docstring."""
    B, N = anchors.shape
    out = torch.zeros(B, 1, N * block, S + N * block, dtype=torch.bool)
    for b in range(B):
        for q in range(N * block):
            n, a = q // block, int(anchors[b, q // block])
            qpos = a + q % block
            if not keep[b, n]:
                out[b, 0, q, S + q] = True
                continue
            for kv in range(S + N * block):
                if kv < S:
                    kpos, ok = kv, kv < a
                else:
                    j = kv - S
                    kpos, ok = int(anchors[b, j // block]) + j % block, j // block == n
                    ok = ok and (not causal or kpos <= qpos)
                ok = ok and (window is None or kpos > qpos - window)
                out[b, 0, q, kv] = ok
    return out


@pytest.mark.parametrize(("window", "causal"), [(None, False), (3, True), (None, True), (5, False)])
def test_train_mask_matches_loop_reference(window, causal):
    anchors = torch.tensor([[1, 4, 9], [2, 6, 0]])
    keep = torch.tensor([[True, True, True], [True, True, False]])
    got = train_mask(anchors, keep, 14, 4, window, causal)
    assert torch.equal(got, _ref_mask(anchors, keep, 14, 4, window, causal))
    if window is None and not causal:  # the full layer is exactly the shared flex mask of draftsmith.drafters.masks
        assert torch.equal(got, dense(dflash_blocks(anchors, keep, 14, 4), 2, 12, 14 + 12))


@pytest.mark.parametrize(("window", "causal"), [(None, False), (3, True)])
def test_decode_mask_is_the_train_mask_row_of_one_block(window, causal):
    a, S = 7, 7
    got = decode_mask(torch.arange(S), torch.arange(a, a + 4), window, causal)
    ref = _ref_mask(torch.tensor([[a]]), torch.tensor([[True]]), S, 4, window, causal)
    assert torch.equal(got, ref)


def test_layer_attention_follows_vllm():
    spec = _spec(layer_types=("sliding_attention", "full_attention"), sliding_window=6)
    assert spec.layer_attention(0) == (6, True) and spec.layer_attention(1) == (None, False)
    assert _spec().layer_attention(1) == (None, False)
    with pytest.raises(ValueError, match="sliding_window"):
        _spec(layer_types=("sliding_attention", "full_attention"))
    with pytest.raises(ValueError, match="selector"):
        _spec(selector_rank=8, draft_vocab_size=20)


def _conv_ref(conv: GroupedConv, x, delta, side) -> torch.Tensor:
    B, Q, H = x.shape
    out = torch.zeros_like(x)
    for b in range(B):
        for t in range(Q):
            for c in range(H):
                for j in range(conv.taps):
                    if t % conv.block_size >= j:
                        coef = conv.base_kernel[side, j, c] + delta[b, t, j, c // conv.group_size]
                        out[b, t, c] += coef * x[b, t - j, c]
    return out


@torch.no_grad()
def test_conv_matches_loop_reference_and_stays_inside_blocks():
    torch.manual_seed(0)
    conv = GroupedConv(hidden_size=8, taps=3, group_size=4, block_size=4)
    conv.base_kernel.normal_()
    conv.kernel_projection.weight.normal_()
    x, y = torch.randn(2, 8, 8), torch.randn(2, 8, 8)
    out, delta1 = conv.prepare(x)
    delta = conv.kernel_projection(x).view(2, 8, 2, 3, 2)
    assert torch.allclose(out, _conv_ref(conv, x, delta[:, :, 0], 0), atol=1e-5)
    assert torch.allclose(conv.finish(y, delta1), _conv_ref(conv, y, delta[:, :, 1], 1), atol=1e-5)
    x2 = x.clone()
    x2[:, :4] += 1.0  # block 0 changes; block 1's rows depend only on block 1
    assert torch.equal(conv.prepare(x2)[0][:, 4:], out[:, 4:])
    assert not torch.allclose(conv.prepare(x2)[0][:, :4], out[:, :4])


@torch.no_grad()
def test_conv_is_identity_at_init():
    plain = _random(DFlashDrafter(_spec()))
    conv = DFlashDrafter(_spec(conv_kernel_size=2, conv_group_size=8))
    missing, _ = conv.load_state_dict(plain.state_dict(), strict=False)
    assert missing and all("_conv." in k for k in missing)
    ids, feats = torch.randint(0, 59, (1, 16)), torch.randn(1, 16, 72)
    anchors, keep = torch.tensor([[3, 9]]), torch.tensor([[True, True]])
    assert torch.allclose(conv.train_hidden(ids, feats, anchors, keep), plain.train_hidden(ids, feats, anchors, keep))
    with torch.no_grad():
        conv.get_parameter("layers.0.mlp_conv.kernel_projection.weight").normal_()
    assert not torch.allclose(
        conv.train_hidden(ids, feats, anchors, keep), plain.train_hidden(ids, feats, anchors, keep), atol=1e-4
    )


CASES: dict[str, dict[str, Any]] = {
    "gqa-full": {},
    "gqa-conv-sliding": dict(
        conv_kernel_size=2, conv_group_size=8, layer_types=("sliding_attention", "full_attention"), sliding_window=3
    ),
    "mla-full": dict(attention="mla", mla=MLA),
    "mla-conv-sliding-fcnorm": dict(
        attention="mla",
        mla=MLA,
        conv_kernel_size=2,
        conv_group_size=8,
        layer_types=("full_attention", "sliding_attention"),
        sliding_window=5,
        fc_norm=True,
    ),
    "dspark-pruned": dict(predict_anchor=True, draft_vocab_size=20),
}


@pytest.mark.parametrize("case", list(CASES))
@torch.no_grad()
def test_train_hidden_equals_decode(case):
    """Block at anchor a in the packed forward == context_kv(taps < a) + blocks with decode_masks."""
    model = _random(DFlashDrafter(_spec(**CASES[case])))
    torch.manual_seed(2)
    S = 18
    ids, feats = torch.randint(0, 59, (2, S)), torch.randn(2, S, 72)
    anchors = torch.tensor([[0, 5, 9, 14], [2, 3, 11, 0]])
    keep = torch.tensor([[True, True, True, True], [True, True, True, False]])
    packed = model.train_hidden(ids, feats, anchors, keep)
    for b in range(2):
        for n in range(4):
            if not keep[b, n]:
                continue
            a = int(anchors[b, n])
            ctx_kv = model.context_kv(model.context(feats[b : b + 1, :a]), torch.arange(a))
            block_ids = torch.full((1, 4), 59)
            block_ids[0, 0] = ids[b, a]
            pos = torch.arange(a, a + 4)
            h = model.blocks(block_ids, pos[None], ctx_kv, model.decode_masks(torch.arange(a), pos))
            assert torch.allclose(packed[b, n], h[0], atol=1e-5), (case, b, n)


@torch.no_grad()
def test_mla_context_kv_equals_mla_projection():
    model = _random(DFlashDrafter(_spec(attention="mla", mla=MLA)))
    attn = model.get_submodule("layers.0.self_attn")
    assert isinstance(attn, DFlashMLA)
    x, pos = torch.randn(2, 7, 32), torch.arange(3, 10)
    _, k, v = MLAProjection.project(attn, x, pos)
    k2, v2 = attn.kv(x, pos)
    assert torch.allclose(k, k2) and torch.allclose(v, v2)


def test_vllm_parameter_names():
    model = DFlashDrafter(_spec(conv_kernel_size=2, conv_group_size=8, selector_rank=4, fc_norm=True))
    names = set(model.state_dict())
    for n in [
        "embed_tokens.weight",
        "fc.weight",
        "fc_norm.2.weight",
        "hidden_norm.weight",
        "norm.weight",
        "lm_head.weight",
        "layers.1.self_attn.q_norm.weight",
        "layers.1.self_attn.k_norm.weight",
        "layers.0.self_attn.o_proj.weight",
        "layers.1.attention_conv.base_kernel",
        "layers.1.mlp_conv.kernel_projection.weight",
        "candidate_selector.predecessor_codebook",
        "candidate_selector.successor_codebook",
        "candidate_selector.hidden_projection.weight",
    ]:
        assert n in names, n
    assert model.get_parameter("layers.0.attention_conv.base_kernel").shape == (2, 2, 32)
    assert model.get_parameter("layers.0.mlp_conv.kernel_projection.weight").shape == (2 * 2 * 4, 32)
    mla = DFlashDrafter(_spec(attention="mla", mla=MLA)).state_dict()
    assert "layers.0.self_attn.kv_a_proj_with_mqa.weight" in mla and "layers.0.self_attn.q_a_layernorm.weight" in mla


@pytest.mark.parametrize("pruned", [False, True])
def test_gradients_reach_trainable_parts_only(pruned):
    kw = dict(draft_vocab_size=40) if pruned else dict(selector_rank=8, selector_top_k=4)
    model = DFlashDrafter(_spec(conv_kernel_size=2, conv_group_size=8, fc_norm=True, **kw))
    if pruned:
        model.d2t.zero_()
        model.t2d[:40] = True
    torch.manual_seed(3)
    batch = {
        "input_ids": torch.randint(0, 40, (2, 24)),
        "loss_mask": torch.ones(2, 24, dtype=torch.bool),
        "features": torch.randn(2, 24, 72),
    }
    loss = dflash_objective(
        model,
        batch,
        target_head_VH=None,
        generator=torch.Generator().manual_seed(0),
        num_anchors=4,
        gamma=4.0,
        selector_alpha=0.5,
    )
    loss.total.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert grads["embed_tokens.weight"] is None
    assert (grads["lm_head.weight"] is not None) == pruned
    got = {n: g for n, g in grads.items() if g is not None}  # a missing one fails its lookup below
    for n in ["fc.weight", "fc_norm.0.weight", "hidden_norm.weight", "layers.0.self_attn.k_proj.weight"]:
        assert got[n].abs().sum() > 0, n
    for n in ["layers.1.mlp.down_proj.weight", "layers.1.attention_conv.kernel_projection.weight"]:
        assert got[n].abs().sum() > 0, n
    assert got["layers.0.mlp_conv.base_kernel"].abs().sum() > 0
    if not pruned:
        for n in ["predecessor_codebook", "successor_codebook", "hidden_projection.weight"]:
            assert got[f"candidate_selector.{n}"].abs().sum() > 0, n
