"""The fast EAGLE-3 step equals the reference one: chain attention by the CPU flash kernel, the counted positions
and target logits made once per step (`target.SharedTarget`, cached per sample), and the whole objective.

Tolerance: fp32 on both sides with the same formulas; only summation orders differ (flash attention's blocked
softmax, one matmul over a vocabulary split instead of the whole), so values agree to a few fp32 ulps of their
magnitude: rtol 1e-4 / atol 1e-5 of the largest gradient element (loss terms: 2e-5).
"""

import pytest
import torch
from torch.testing import assert_close

from draftsmith import kernels
from draftsmith.core.config import Eagle3Config
from draftsmith.drafters import vocab
from draftsmith.drafters.eagle3 import family, loss
from draftsmith.drafters.eagle3.chain_attention import ChainAttention, chain_attention_reference
from draftsmith.drafters.eagle3.model import Eagle3Drafter, Eagle3Spec
from draftsmith.drafters.eagle3.target import SharedTarget, in_draft

pytestmark = pytest.mark.unit

B, S, H, V, VD = 2, 24, 32, 60, 20


def _close(a: torch.Tensor, b: torch.Tensor, msg: str) -> None:
    assert_close(a, b, rtol=1e-4, atol=1e-5 * max(1.0, float(b.abs().max())), msg=msg)


@pytest.mark.parametrize("extra", [0, 1, 3])
def test_chain_attention_by_flash_equals_the_full_softmax(extra):
    g = torch.Generator().manual_seed(extra)
    h, d = 3, 8
    # Non-contiguous views, as the projections hand them over ([B, S, h, d] transposed).
    leaves = [torch.randn(B, S, h, d, generator=g).requires_grad_(True) for _ in range(3 + 2 * extra)]
    views = [t.transpose(1, 2) for t in leaves]
    q, k, v, diag = views[0], views[1], views[2], views[3:]
    w = torch.randn(B, h, S, d, generator=g)
    results = []
    for fn in (chain_attention_reference, None):
        for t in leaves:
            t.grad = None
        if fn is None:
            out = ChainAttention.apply(q, k, v, 0.35, *diag)
        else:
            out = fn(q, k, v, diag[:extra], diag[extra:], 0.35)
        (out * w).sum().backward()
        grads = [t.grad for t in leaves]
        assert all(g is not None for g in grads)
        results.append((out.detach(), [g.clone() for g in grads if g is not None]))
    (ref, ref_grads), (fast, fast_grads) = results
    _close(fast, ref, "out")
    for i, (f, r) in enumerate(zip(fast_grads, ref_grads, strict=True)):
        _close(f, r, f"grad {i}")


def _vocab(g: torch.Generator):
    d2t, t2d = vocab.build_draft_vocab(torch.randint(0, 100, (V,), generator=g), VD)
    return d2t, t2d


def _batch(g: torch.Generator, head: torch.Tensor, t2d: torch.Tensor) -> dict[str, torch.Tensor]:
    loss_mask = torch.ones(B, S, dtype=torch.bool)
    loss_mask[0, :5] = False
    loss_mask[1, -7:] = False  # a padded row
    return {
        "input_ids": torch.randint(0, V, (B, S), generator=g),
        "features": torch.randn(B, S, 3 * H, generator=g),
        "loss_mask": loss_mask,
        "last_hidden": torch.randn(B, S, H, generator=g),
    }


def test_in_draft_is_the_full_vocabulary_argmax_test_ties_included():
    g = torch.Generator().manual_seed(1)
    d2t, t2d = _vocab(g)
    head = torch.randn(V, H, generator=g)
    hidden = torch.randn(40, H, generator=g)
    draft_ids, rest_ids = vocab.draft_ids(d2t), (~t2d).nonzero().squeeze(1)
    # Exact ties between a draft id and another id: the smaller id wins, as in torch.argmax.
    head[rest_ids[0]] = head[draft_ids[-1]] * 5
    head[draft_ids[0]] = head[rest_ids[-1]] * 5
    full = hidden @ head.T
    expected = t2d[full.argmax(-1)]
    got = in_draft(hidden @ head[draft_ids].T, hidden, head[rest_ids], draft_ids, rest_ids)
    assert torch.equal(got, expected) and 0 < int(got.sum()) < 40


def test_a_draft_vocabulary_of_the_whole_target_vocabulary_counts_every_loss_position():
    g = torch.Generator().manual_seed(4)
    d2t, t2d = vocab.build_draft_vocab(torch.randint(0, 100, (V,), generator=g), V)
    head = torch.randn(V, H, generator=g)
    batch = _batch(g, head, t2d)
    shared = SharedTarget(head, d2t, t2d)
    mask, logits = shared(batch["loss_mask"], batch["last_hidden"])
    ref_mask = loss.position_mask(batch["loss_mask"], family.draftable(batch, head, t2d))
    assert torch.equal(mask, ref_mask) and int(mask.sum()) == int(batch["loss_mask"][:, 1:].sum())
    assert not shared.cache, "with no other ids there is no argmax test to cache"
    _close(logits, batch["last_hidden"][mask] @ head.T, "target logits")


def test_shared_target_gives_the_reference_mask_and_logits_and_caches_per_sample():
    g = torch.Generator().manual_seed(2)
    d2t, t2d = _vocab(g)
    head = torch.randn(V, H, generator=g)
    head[t2d] *= 1.3  # most, not all, argmaxes are draftable
    batch = _batch(g, head, t2d)
    shared = SharedTarget(head, d2t, t2d)
    ref_mask = loss.position_mask(batch["loss_mask"], family.draftable(batch, head, t2d))
    for _ in range(2):  # the second call answers the argmax test from the cache
        mask, logits = shared(batch["loss_mask"], batch["last_hidden"])
        assert torch.equal(mask, ref_mask) and 0 < int(mask.sum()) < int(batch["loss_mask"].sum())
        _close(logits, batch["last_hidden"][mask] @ head[vocab.draft_ids(d2t)].T, "target logits")
    assert len(shared.cache) == B
    with pytest.MonkeyPatch.context() as mp:  # a cache hit makes no `[m, V - Vd]` product
        mp.setattr("draftsmith.drafters.eagle3.target.in_draft", None)
        assert torch.equal(shared(batch["loss_mask"], batch["last_hidden"])[0], ref_mask)


def _setup(anchored: bool):
    g = torch.Generator().manual_seed(3)
    d2t, t2d = _vocab(g)
    spec = Eagle3Spec(hidden_size=H, target_hidden_size=H, num_taps=3, num_heads=4, num_kv_heads=2, head_dim=8,
                      intermediate_size=64, vocab_size=V, draft_vocab_size=VD)  # fmt: skip
    torch.manual_seed(0)
    model = Eagle3Drafter(spec)
    model.d2t.copy_(d2t)
    model.t2d.copy_(t2d)
    head = torch.randn(V, H, generator=g)
    head[t2d] *= 1.3
    anchors = {"num_anchors": 4, "max_gap": 3} if anchored else None
    cfg = Eagle3Config(draft_vocab_size=VD, ttt_depth=3, anchored=anchors, num_heads=4, num_kv_heads=2, head_dim=8,
                       intermediate_size=64)  # fmt: skip
    return model, head, cfg, _batch(g, head, t2d)


def _step(model, head, cfg, batch, *, fast: bool):
    """One objective call: the fast path (shared target, eager head loss, flash attention) or the reference
    (`draftable`, the per-depth target logits, plain autograd, the full softmax attention)."""
    model.zero_grad()
    objective = family.objective(cfg, model, head, torch.Generator().manual_seed(5), shared=fast)
    with kernels.use("auto" if fast else "reference"):
        if fast:
            out = objective(model, batch)
        else:
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr("draftsmith.drafters.eagle3.model.chain_attention", chain_attention_reference)
                out = objective(model, batch)
    out.total.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("anchored", [False, True])
def test_the_fast_objective_equals_the_reference_loss_and_gradients(anchored):
    model, head, cfg, batch = _setup(anchored)
    ref, ref_grads = _step(model, head, cfg, batch, fast=False)
    fast, fast_grads = _step(model, head, cfg, batch, fast=True)
    for field in ("total", "step_loss", "step_acc", "step_count"):
        assert_close(getattr(fast, field), getattr(ref, field), rtol=2e-5, atol=2e-5, msg=field)
    assert int(ref.step_count.sum()) > 0
    assert fast_grads.keys() == ref_grads.keys() and "lm_head.weight" in fast_grads
    for name in ref_grads:
        _close(fast_grads[name], ref_grads[name], name)


def test_freeze_lm_head_leaves_the_head_out_of_training():
    cfg = Eagle3Config(draft_vocab_size=VD, freeze_lm_head=True, num_heads=4, num_kv_heads=2, head_dim=8,
                       intermediate_size=64)  # fmt: skip
    assert Eagle3Config.model_fields["freeze_lm_head"].default is False  # the default: the head trains
    model, head, _, batch = _setup(False)
    model.lm_head.weight.requires_grad_(not cfg.freeze_lm_head)
    _, grads = _step(model, head, cfg, batch, fast=True)
    assert "lm_head.weight" not in grads and "fc.weight" in grads


def test_the_objective_trains_on_noisy_features_reproducibly():
    model, head, cfg, batch = _setup(False)
    clean, _ = _step(model, head, cfg, batch, fast=True)
    noisy_cfg = cfg.model_copy(update={"feature_noise": 0.2})
    first, grads_a = _step(model, head, noisy_cfg, batch, fast=True)
    again, grads_b = _step(model, head, noisy_cfg, batch, fast=True)
    assert not torch.equal(first.total, clean.total)
    assert torch.equal(first.total, again.total)
    assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)
    assert torch.equal(batch["features"], _setup(False)[3]["features"])  # the batch itself is left as it was
