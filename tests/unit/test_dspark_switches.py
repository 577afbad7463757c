"""DSpark's recipe switches against DeepSpec's choices: each changes what it names and nothing else.

`partial_blocks` (anchors up to the last supervised position, slots past the row end uncounted), `target_vocab`
(with a pruned vocabulary, p_t over the whole target vocabulary or renormalised over the draft ids) and
`init_std` (N(0, std) everywhere, or torch's defaults with markov_w1 N(0, 1) and markov_w2 zeros).
"""

import types
from typing import cast

import pytest
import torch
import torch.nn.functional as F

from draftsmith.core.config import DSparkConfig, TargetConfig
from draftsmith.drafters import families
from draftsmith.drafters.dflash.loss import slot_labels, slot_weights
from draftsmith.drafters.dspark import family
from draftsmith.drafters.dspark import model as dspark_model
from draftsmith.drafters.dspark.heads import FullVocabHead, normal_init
from draftsmith.drafters.dspark.loss import OUTSIDE_DRAFT_LOGIT, outside_column, outside_logsumexp
from draftsmith.drafters.dspark.model import DSparkDrafter, dspark_objective
from draftsmith.drafters.layers import HeadLossCall, RMSNorm
from draftsmith.kernels import Target, head_loss
from tests.support.models import DSPARK_HT as HT
from tests.support.models import DSPARK_K as K
from tests.support.models import DSPARK_TAPS as TAPS
from tests.support.models import DSPARK_V as V
from tests.support.models import ODD_D2T, ODD_T2D, dspark_batch, dspark_drafter, small_llama

pytestmark = pytest.mark.unit


def _objective(model, batch, head, *, seed: int = 7, num_anchors: int = 3, **kw):
    g = torch.Generator().manual_seed(seed)
    return dspark_objective(model, batch, target_head_VH=head, generator=g, num_anchors=num_anchors, **kw)


def _pruned(seed: int = 0, d2t=ODD_D2T, t2d=ODD_T2D) -> DSparkDrafter:
    model = dspark_drafter(seed, draft_vocab_size=len(d2t))
    model.d2t.copy_(d2t)
    model.t2d.copy_(t2d)
    return model


def _head(seed: int = 3) -> torch.Tensor:
    return 2.0 * torch.randn(V, HT, generator=torch.Generator().manual_seed(seed))


# --- config -------------------------------------------------------------------------------------------------


def _config(**kw) -> DSparkConfig:
    base = dict(num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48, mask_token_id=V - 1, markov_rank=8)
    return DSparkConfig(**(base | dict(num_layers=2, block_size=K) | kw))


def test_config_defaults_are_the_reference_choices_and_the_old_ones_stay_selectable():
    cfg = _config()
    assert (cfg.partial_blocks, cfg.target_vocab, cfg.init_std) == (True, "full", 0.02)
    old = _config(partial_blocks=False, target_vocab="draft", init_std=None)
    assert (old.partial_blocks, old.target_vocab, old.init_std) == (False, "draft", None)
    for bad in (dict(init_std=0.0), dict(target_vocab="pruned"), dict(partial_blocks="yes")):
        with pytest.raises(ValueError):
            _config(**bad)


def test_family_objective_passes_the_switches_through():
    cfg = _config(partial_blocks=False, target_vocab="draft")
    obj = family.objective(cfg, dspark_drafter(), torch.zeros(V, HT), torch.Generator())
    assert obj.keywords["partial_blocks"] is False and obj.keywords["target_vocab"] == "draft"
    assert (
        family.objective(_config(), dspark_drafter(), torch.zeros(V, HT), torch.Generator()).keywords["target_vocab"]
        == "full"
    )


def test_objective_rejects_an_unknown_target_vocabulary():
    with pytest.raises(ValueError, match="target_vocab"):
        _objective(dspark_drafter(), dspark_batch(), _head(), target_vocab="pruned")


# --- partial_blocks -------------------------------------------------------------------------------------------


def _recorded_anchors(monkeypatch) -> list:
    seen = []
    real = dspark_model.uniform_anchors

    def spy(*args, **kw):
        out = real(*args, **kw)
        seen.append(out)
        return out

    monkeypatch.setattr(dspark_model, "uniform_anchors", spy)
    return seen


@pytest.mark.parametrize("partial_blocks", [True, False], ids=["partial", "whole"])
def test_every_candidate_anchor_and_which_slots_count(monkeypatch, partial_blocks):
    """With more anchor slots than candidates every candidate is an anchor: the partial rule reaches the last
    supervised position (S - 2), whose later slots fall past the row end and are not counted."""
    batch, S = dspark_batch(), 14
    seen = _recorded_anchors(monkeypatch)
    out = _objective(dspark_drafter(), batch, _head(), num_anchors=S, partial_blocks=partial_blocks)
    (anchors, keep), mask = seen[0], batch["loss_mask"]
    last = S - 2 if partial_blocks else S - K - 1
    for b in range(2):
        expected = [a for a in range(last + 1) if mask[b, a] and mask[b, a + 1]]
        assert anchors[b][keep[b]].tolist() == expected
    # Slot k of anchor a counts iff a + 1 .. a + k + 1 are all inside the row and supervised.
    counts = torch.zeros(K, dtype=torch.long)
    for b in range(2):
        for a in anchors[b][keep[b]].tolist():
            for k in range(K):
                if a + k + 1 >= S or not bool(mask[b, a + 1 : a + k + 2].all()):
                    break
                counts[k] += 1
    assert out.step_count.tolist() == counts.tolist()
    # The row's last label (S - 1) is predicted from slot 0 (anchor S - 2) too, not only from the last slot.
    assert (int(anchors[0][keep[0]].max()) == S - 2) == partial_blocks


def test_partial_block_slots_past_the_row_end_are_masked():
    batch, S = dspark_batch(), 14
    anchors, keep = torch.tensor([[S - 2, S - 3], [5, S - 2]]), torch.ones(2, 2, dtype=torch.bool)
    labels, valid = slot_labels(batch["input_ids"], batch["loss_mask"], anchors, keep, K, predict_anchor=True)
    assert valid[0, 0].tolist() == [True] + [False] * (K - 1)
    assert valid[0, 1].tolist() == [True, True] + [False] * (K - 2)
    assert valid[1, 0].tolist() == [True] * 4  # 6..9 supervised, then the hole at 10 (K = 4 stops before it)
    assert labels[0, 0, 0] == batch["input_ids"][0, S - 1] and int(labels[0, 0, 1:].abs().sum()) == 0


def test_partial_blocks_change_nothing_when_rows_end_in_padding():
    """Rows whose last K positions are unsupervised have no candidate within K of the end under either rule: the
    same anchors, so the same loss, bit for bit."""
    batch = dspark_batch()
    batch["loss_mask"][:, -K:] = False
    model, head = dspark_drafter(), _head()
    a = _objective(model, batch, head, num_anchors=5, partial_blocks=True)
    b = _objective(model, batch, head, num_anchors=5, partial_blocks=False)
    assert torch.equal(a.total, b.total) and torch.equal(a.step_count, b.step_count)
    c = _objective(model, dspark_batch(), head, num_anchors=5, partial_blocks=True)
    d = _objective(model, dspark_batch(), head, num_anchors=5, partial_blocks=False)
    assert not torch.equal(c.step_count, d.step_count)  # on rows supervised to the end the rule does differ


# --- target_vocab ---------------------------------------------------------------------------------------------


def test_without_pruning_both_target_vocabularies_are_the_same_loss():
    model, batch, head = dspark_drafter(), dspark_batch(), _head()
    full = _objective(model, batch, head, target_vocab="full")
    draft = _objective(model, batch, head, target_vocab="draft")
    assert torch.equal(full.total, draft.total) and torch.equal(full.step_loss, draft.step_loss)


def test_a_draft_vocabulary_of_every_id_agrees_with_the_renormalised_form():
    every = torch.zeros(V, dtype=torch.int64), torch.ones(V, dtype=torch.bool)
    model, batch, head = _pruned(d2t=every[0], t2d=every[1]), dspark_batch(), _head()
    full = _objective(model, batch, head, target_vocab="full")
    draft = _objective(model, batch, head, target_vocab="draft")
    torch.testing.assert_close(full.total, draft.total, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(full.step_loss, draft.step_loss, rtol=1e-6, atol=1e-6)


def _by_hand(model, batch, head, seed: int, num_anchors: int, full_vocab: bool) -> torch.Tensor:
    """The DSpark total from whole-block logits, p_t over all V ids (or renormalised over the draft ids)."""
    from draftsmith.drafters.anchors import uniform_anchors

    anchors, keep = uniform_anchors(batch["loss_mask"], num_anchors, torch.Generator().manual_seed(seed), depth=2)
    ids = batch["input_ids"]
    logits, conf, _ = model.train_outputs(ids, batch["features"], anchors, keep)
    labels, valid = slot_labels(ids, batch["loss_mask"], anchors, keep, K, predict_anchor=True)
    index = torch.full((V,), -1, dtype=torch.long)
    kept = torch.arange(model.spec.draft_vocab_size) + model.d2t
    index[kept] = torch.arange(kept.numel())
    valid = valid & (index[labels] >= 0)
    b, n, k = valid.nonzero(as_tuple=True)
    zt = batch["last_hidden"][b, anchors[b, n] + k] @ head.T  # [n, V]
    p_t = zt.softmax(-1)[:, kept] if full_vocab else zt[:, kept].softmax(-1)
    p_d = logits[b, n, k].softmax(-1)
    l1 = (p_d - p_t).abs().sum(-1) + (1.0 - p_t.sum(-1))  # the outside mass: p_d is 0 there
    ce = -p_d.log().gather(-1, index[labels[b, n, k]][:, None]).squeeze(-1)
    bce = F.binary_cross_entropy_with_logits(conf[b, n, k], (1 - l1 / 2).clamp(0, 1), reduction="none")
    w = slot_weights(K, 4.0, True)[k]
    return sum(m * (w * t).sum() / w.sum() for m, t in zip((0.1, 0.9, 1.0), (ce, l1, bce), strict=True))


@pytest.mark.parametrize("target_vocab", ["full", "draft"])
def test_pruned_objective_equals_the_loss_by_hand(target_vocab):
    model, batch, head = _pruned(), dspark_batch(), _head()
    out = _objective(model, batch, head, target_vocab=target_vocab, num_anchors=4)
    with torch.no_grad():
        ref = _by_hand(model, batch, head, 7, 4, full_vocab=target_vocab == "full")
        other = _by_hand(model, batch, head, 7, 4, full_vocab=target_vocab != "full")
    assert float(out.total.detach()) == pytest.approx(float(ref), abs=1e-5)
    assert abs(float(ref) - float(other)) > 1e-3  # the two targets do differ on this vocabulary


Tensors8 = tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
]


def _head_case(seed: int = 0, n: int = 9, D: int = 6, Vd: int = 7, Vt: int = 15, r: int = 3) -> Tensors8:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D, generator=g, requires_grad=True)
    weight = torch.randn(Vd, D, generator=g, requires_grad=True)
    emb = torch.randn(n, r, generator=g)
    w2 = torch.randn(Vd, r, generator=g, requires_grad=True)
    hidden, head = torch.randn(n, HT, generator=g), 3.0 * torch.randn(Vt, HT, generator=g)
    t2d = torch.zeros(Vt, dtype=torch.bool)
    t2d[torch.randperm(Vt, generator=g)[:Vd].sort().values] = True
    labels = torch.randint(0, Vd, (n,), generator=g)
    return x, weight, emb, w2, hidden, head, t2d, labels


def test_outside_logsumexp_is_the_mass_outside_the_draft_ids():
    _, _, _, _, hidden, head, t2d, _ = _head_case()
    z = hidden @ head.T
    torch.testing.assert_close(outside_logsumexp(hidden, head, t2d), z[:, ~t2d].logsumexp(-1))
    torch.testing.assert_close(outside_logsumexp(hidden, head, t2d, chunk_rows=2), z[:, ~t2d].logsumexp(-1))
    every = torch.ones_like(t2d)
    assert torch.equal(outside_logsumexp(hidden, head, every), torch.full((9,), OUTSIDE_DRAFT_LOGIT))


def _fused(x, weight, emb, w2, hidden, head, t2d, labels, outside: bool, w_l1: bool = True):
    n = x.shape[0]
    call = HeadLossCall(
        target=Target(hidden=hidden, head=head[t2d]),
        labels=labels,
        w_ce=torch.full((n,), 0.3),
        w_l1=torch.full((n,), 0.5) if w_l1 else None,
        extra=(emb, w2),
    )
    if outside:
        weight, call = outside_column(weight, call, outside_logsumexp(hidden, head, t2d))
    return head_loss(
        x, weight, mode="reference", target=call.target, labels=call.labels, w_ce=call.w_ce, w_l1=call.w_l1,
        extra=call.extra,
    )  # fmt: skip


def test_outside_column_adds_the_outside_mass_to_l1_and_changes_nothing_else():
    case = _head_case()
    x, weight, emb, w2, hidden, head, t2d, labels = case
    renorm, full = _fused(*case, outside=False), _fused(*case, outside=True)
    p_t = (hidden @ head.T).softmax(-1)
    p_d = (x @ weight.T + emb @ w2.T).softmax(-1)
    expected = (p_d - p_t[:, t2d]).abs().sum(-1) + p_t[:, ~t2d].sum(-1)
    torch.testing.assert_close(full.l1, expected.detach())
    # The renormalised target is optimistic: L1 to it is never above L1 to the full distribution.
    assert bool((full.l1 >= renorm.l1 - 1e-6).all()) and float((full.l1 - renorm.l1).max()) > 1e-3
    torch.testing.assert_close(full.ce, renorm.ce)
    assert torch.equal(full.hit, renorm.hit)
    # CE alone: the same loss and the same gradients (p_d of the outside column is exactly 0).
    grads = []
    for outside in (False, True):
        out = _fused(*case, outside=outside, w_l1=False)
        grads.append(torch.autograd.grad(out.loss, (x, weight, w2)))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)


def test_outside_column_keeps_the_normaliser_in_the_heads_dtype():
    x, weight, emb, w2, hidden, head, t2d, labels = _head_case()
    outside = outside_logsumexp(hidden, head, t2d) + 0.01  # not a bf16 value
    call = HeadLossCall(target=Target(hidden=hidden.bfloat16(), head=head[t2d]), labels=labels, extra=(emb, w2))
    _, wide = outside_column(weight, call, outside)
    assert wide.target is not None and wide.target.hidden is not None
    assert wide.target.hidden.dtype == torch.float32 and torch.equal(wide.target.hidden[:, -1], outside)
    assert torch.equal(wide.target.rows(0, 9, 8)[:, -1], outside)


def test_full_vocab_head_takes_over_the_backbone_head_without_drawing():
    state = torch.get_rng_state()
    FullVocabHead(8, 5)
    assert torch.equal(torch.get_rng_state(), state)
    model = _pruned()
    assert isinstance(model.lm_head, FullVocabHead) and tuple(model.lm_head.weight.shape) == (24, 32)
    assert "fused_loss_with_outside" in FullVocabHead.fsdp_forward_methods
    assert type(dspark_drafter().lm_head) is not FullVocabHead  # the shared, frozen head needs no outside column


# --- init_std ---------------------------------------------------------------------------------------------------


def _inputs():
    target_model = small_llama(V, HT, seed=4)
    target = cast(TargetConfig, types.SimpleNamespace(hidden_size=HT, vocab_size=V))  # what build reads of it
    return families.BuildInputs(target, target_model, TAPS, torch.arange(V, dtype=torch.float32))


def _trained_2d(model) -> dict[str, torch.Tensor]:
    skip = ("embed_tokens.weight", "lm_head.weight")
    return {n: p.detach() for n, p in model.named_parameters() if p.ndim == 2 and n not in skip}


@pytest.mark.parametrize("draft_vocab_size", [None, 24], ids=["shared", "pruned"])
def test_reference_init_is_normal_002_everywhere_and_the_shared_weights_are_the_targets(draft_vocab_size):
    inputs = _inputs()
    torch.manual_seed(0)
    model = family.build(_config(draft_vocab_size=draft_vocab_size, markov_rank=64), inputs)
    weights = _trained_2d(model)
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "fc.weight"} <= set(weights)
    for name, w in weights.items():
        assert abs(float(w.mean())) < 0.01 and float(w.std()) == pytest.approx(0.02, rel=0.2), name
    assert int(torch.count_nonzero(model.confidence_head.proj.bias)) == 0
    for m in model.modules():
        if isinstance(m, RMSNorm):
            assert torch.equal(m.weight, torch.ones_like(m.weight))
    target_head = inputs.target_model.get_output_embeddings().weight
    assert torch.equal(model.embed_tokens.weight, inputs.target_model.get_input_embeddings().weight)
    rows = target_head if draft_vocab_size is None else target_head[torch.arange(24) + model.d2t]
    assert torch.equal(model.lm_head.weight, rows)


def test_old_init_keeps_torch_defaults_with_a_zero_markov_w2():
    inputs = _inputs()
    torch.manual_seed(0)
    model = family.build(_config(init_std=None, markov_rank=64), inputs)
    head = model.markov_head
    assert int(torch.count_nonzero(head.markov_w2.weight)) == 0
    assert float(head.markov_w1.weight.std()) == pytest.approx(1.0, rel=0.1)
    fc = model.fc.weight  # kaiming-uniform: |w| <= 1 / sqrt(fan_in)
    assert float(fc.abs().max()) <= fc.shape[1] ** -0.5 and float(fc.std()) > 0.1 * fc.shape[1] ** -0.5
    # The old init is what the drafter is built with: the switch re-draws nothing else.
    torch.manual_seed(0)
    fresh = DSparkDrafter(model.spec)
    for (name, a), b in zip(_trained_2d(model).items(), _trained_2d(fresh).values(), strict=True):
        assert torch.equal(a, b), name


def test_normal_init_covers_every_parameter_kind():
    model = dspark_drafter()
    normal_init(model, 0.5)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            assert int(torch.count_nonzero(p)) == 0, name
        elif p.ndim == 1:
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            assert float(p.std()) == pytest.approx(0.5, rel=0.35), name
