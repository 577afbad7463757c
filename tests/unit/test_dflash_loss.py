"""Block labels, slot weights, the weighted CE and the DFlash2 selector on hand-checkable cases."""

import math

import pytest
import torch

from draftsmith.drafters.dflash import DFlashDrafter, DFlashSpec
from draftsmith.drafters.dflash.loss import dflash_loss, dflash_objective, slot_labels, slot_weights
from draftsmith.drafters.dflash.selector import CandidateSelector, candidates_with_gold, selector_loss, walk

pytestmark = pytest.mark.unit

IDS = (torch.arange(10) + 100)[None]
MASK = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1, 1, 1]], dtype=torch.bool)
ANCHORS = torch.tensor([[1, 2, 8, 6]])
KEEP = torch.tensor([[True, True, True, False]])


def test_slot_labels_dflash():
    labels, valid = slot_labels(IDS, MASK, ANCHORS, KEEP, 4, predict_anchor=False)
    assert valid.tolist() == [
        [[False, True, True, True], [False, True, True, False], [False, True, False, False], [False] * 4]
    ]
    assert labels[0, 0].tolist() == [0, 102, 103, 104]
    assert labels[0, 1, 1:3].tolist() == [103, 104]
    assert labels[0, 2, 1] == 109


def test_slot_labels_dspark():
    labels, valid = slot_labels(IDS, MASK, ANCHORS, KEEP, 4, predict_anchor=True)
    assert valid.tolist() == [
        [[True, True, True, False], [True, True, False, False], [True, False, False, False], [False] * 4]
    ]
    assert labels[0, 0].tolist() == [102, 103, 104, 0]
    assert labels[0, 2, 0] == 109


def test_slot_weights():
    assert torch.allclose(slot_weights(4, 2.0, False), torch.tensor([0.0, 1.0, math.exp(-0.5), math.exp(-1.0)]))
    assert torch.allclose(
        slot_weights(4, 4.0, True), torch.tensor([1.0, math.exp(-0.25), math.exp(-0.5), math.exp(-0.75)])
    )


def test_dflash_loss_is_the_weighted_mean_over_valid_slots():
    logits = torch.zeros(1, 2, 3, 3)
    logits[0, 0, 2] = torch.tensor([10.0, 0.0, 0.0])
    logits[0, 1, 1] = torch.tensor([0.0, 0.0, 4.0])
    labels = torch.tensor([[[0, 1, 0], [0, 2, 0]]])
    valid = torch.tensor([[[False, True, True], [False, True, False]]])
    w = torch.tensor([0.0, 1.0, 0.5])
    out = dflash_loss(logits, labels, valid, w)
    ce_uniform = math.log(3)
    ce_sharp = math.log(1 + 2 * math.exp(-10))
    ce_good = math.log(1 + 2 * math.exp(-4))
    assert out.step_count.tolist() == [0, 2, 1]
    assert torch.allclose(out.step_loss, torch.tensor([0.0, (ce_uniform + ce_good) / 2, ce_sharp]), atol=1e-6)
    assert torch.allclose(out.step_acc, torch.tensor([0.0, 0.5, 1.0]))
    expected = (ce_uniform + ce_good + 0.5 * ce_sharp) / 2.5
    assert math.isclose(float(out.total), expected, rel_tol=1e-6)


def test_dflash_loss_maps_labels_into_the_pruned_vocabulary():
    t2d = torch.tensor([True, False, True, False, False, True])  # draft ids 0, 1, 2 = target 0, 2, 5
    logits = torch.zeros(1, 1, 3, 3)
    logits[0, 0, 1] = torch.tensor([0.0, 0.0, 5.0])
    labels = torch.tensor([[[0, 5, 3]]])  # target 5 -> draft 2; target 3 is not draftable
    valid = torch.tensor([[[False, True, True]]])
    out = dflash_loss(logits, labels, valid, torch.ones(3), t2d_V=t2d)
    assert out.step_count.tolist() == [0, 1, 0]
    assert out.step_acc[1] == 1.0
    assert math.isclose(float(out.total), math.log(1 + 2 * math.exp(-5)), rel_tol=1e-6)


def _hand_selector() -> CandidateSelector:
    sel = CandidateSelector(hidden_size=2, vocab_size=4, rank=2, top_k=2)
    with torch.no_grad():
        ids = torch.arange(4.0)
        sel.predecessor_codebook.copy_(torch.stack([ids, torch.ones(4)], 1))  # A(a) = [a, 1]
        sel.successor_codebook.copy_(torch.stack([torch.ones(4), ids], 1))  # B(b) = [1, b]
        sel.hidden_projection.weight.copy_(torch.eye(2))
    return sel


@torch.no_grad()
def test_edge_scores_by_hand():
    """With h = [1, 2]: S(a, b) = U(b) + a + 2b."""
    sel = _hand_selector()
    cand = torch.tensor([[[1, 3], [2, 0]]])
    unary = torch.tensor([[[0.5, -1.0], [2.0, 0.0]]])
    h = torch.tensor([[[1.0, 2.0], [1.0, 2.0]]])
    scores = sel.edge_scores(cand, unary, h, anchor_B=torch.tensor([2]))
    # slot 0: predecessor is the anchor 2 for both rows
    assert scores[0, 0].tolist() == [[0.5 + 2 + 2, -1.0 + 2 + 6]] * 2
    # slot 1: predecessors are slot 0's candidates 1 and 3
    assert scores[0, 1].tolist() == [[2.0 + 1 + 4, 0.0 + 1 + 0], [2.0 + 3 + 4, 0.0 + 3 + 0]]


def test_walk_follows_the_chosen_row():
    cand = torch.tensor([[[10, 11], [20, 21], [30, 31]]])
    scores = torch.zeros(1, 3, 2, 2)
    scores[0, 0] = torch.tensor([[0.0, 1.0], [0.0, 1.0]])  # -> index 1 (11)
    scores[0, 1] = torch.tensor([[0.0, 9.0], [5.0, 2.0]])  # row 1 -> index 0 (20); row 0 would give 21
    scores[0, 2] = torch.tensor([[0.0, 3.0], [7.0, 0.0]])  # row 0 -> index 1 (31)
    assert walk(scores, cand).tolist() == [[11, 20, 31]]


def test_gold_injection_replaces_the_lowest_candidate():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0], [5.0, 4.0, 3.0, 2.0, 1.0]])
    cand, index = candidates_with_gold(logits, torch.tensor([4, 1]), 3)
    assert cand.tolist() == [[0, 1, 4], [0, 1, 2]]
    assert index.tolist() == [2, 1]


@torch.no_grad()
def test_selector_loss_by_hand():
    sel = _hand_selector()
    logits = torch.tensor([[0.0, 1.0, 0.0, 3.0]])  # top-2: 3, 1; gold 2 replaces 1
    h = torch.tensor([[1.0, 2.0]])
    loss = selector_loss(sel, logits, h, pred_n=torch.tensor([1]), gold_n=torch.tensor([2]))
    s = torch.tensor([3.0 + 1 + 6, 0.0 + 1 + 4])  # U(b) + a + 2b for b = 3, 2 with a = 1
    assert math.isclose(loss.item(), float(-s.log_softmax(0)[1]), rel_tol=1e-6)


def test_objective_adds_alpha_times_the_selector_loss():
    spec = DFlashSpec(
        hidden_size=16,
        target_hidden_size=8,
        num_taps=2,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        intermediate_size=32,
        vocab_size=30,
        block_size=4,
        selector_rank=4,
        selector_top_k=3,
    )
    torch.manual_seed(0)
    model = DFlashDrafter(spec)
    batch = {
        "input_ids": torch.randint(0, 30, (2, 16)),
        "loss_mask": torch.ones(2, 16, dtype=torch.bool),
        "features": torch.randn(2, 16, 16),
    }

    def run(alpha):
        g = torch.Generator().manual_seed(0)
        return dflash_objective(
            model, batch, target_head_VH=None, generator=g, num_anchors=3, gamma=4.0, selector_alpha=alpha
        )

    base, half, full = run(0.0), run(0.5), run(1.0)
    assert torch.equal(base.step_loss, half.step_loss)
    diff = (half.total - base.total).item()
    assert diff > 0 and int(base.step_count.sum()) == 2 * 3 * 3
    assert abs((full.total - base.total).item() - 2 * diff) < 1e-5
