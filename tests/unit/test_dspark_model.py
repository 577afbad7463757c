"""The DSpark drafter: vLLM's parameter names, teacher forcing, training == decoding, the objective, and lossless
greedy speculative decoding on the tiny target."""

import pytest
import torch

from draftsmith.drafters.dflash.loss import slot_labels, slot_weights
from draftsmith.drafters.dspark.decode import DraftBlock, draft_block, propose
from draftsmith.drafters.dspark.loss import dspark_loss, target_logp
from draftsmith.drafters.dspark.model import DSparkDrafter, dspark_objective, output_labels
from tests.support.models import DSPARK_HT as HT
from tests.support.models import DSPARK_K as K
from tests.support.models import DSPARK_V as V
from tests.support.models import (
    ODD_D2T,
    ODD_T2D,
    TAPS3,
    dspark_batch,
    dspark_drafter,
    dspark_spec,
    random_dspark,
    small_llama,
)

pytestmark = pytest.mark.unit


def test_parameter_names_match_vllm_dspark():
    model = dspark_drafter(draft_vocab_size=24)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    # vLLM: markov_w1 embeds target ids [V, r]; markov_w2 biases the draft vocabulary [Vd, r];
    # confidence_head.proj = Linear(H + r, 1, bias=True).
    assert shapes["markov_head.markov_w1.weight"] == (V, 8)
    assert shapes["markov_head.markov_w2.weight"] == (24, 8)
    assert shapes["confidence_head.proj.weight"] == (1, 32 + 8)
    assert shapes["confidence_head.proj.bias"] == (1,)
    assert {"d2t", "t2d", "lm_head.weight", "fc.weight", "hidden_norm.weight", "norm.weight"} <= set(shapes)
    without = DSparkDrafter(dspark_spec(enable_confidence_head=False))
    assert not any(k.startswith("confidence_head") for k in without.state_dict())


def test_spec_rejects_a_non_predicting_anchor_slot():
    with pytest.raises(ValueError, match="predict_anchor"):
        dspark_spec(predict_anchor=False)
    with pytest.raises(ValueError, match="markov_rank"):
        dspark_spec(markov_rank=0)


def test_teacher_forced_previous_tokens():
    model = dspark_drafter()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    # Anchor 1: [token 1 (the anchor), gold 2, 3, 4]; anchor 5: [10, 11, clamped, clamped].
    prev = model.prev_tokens(ids, torch.tensor([[1, 5]]))
    assert prev.tolist() == [[[6, 7, 8, 9], [10, 11, 11, 11]]]


def test_train_outputs_add_the_markov_bias_of_the_previous_gold_token():
    model = dspark_drafter()
    batch = dspark_batch()
    anchors, keep = torch.tensor([[3, 6], [4, 8]]), torch.ones(2, 2, dtype=torch.bool)
    with torch.no_grad():
        logits, conf, emb = model.train_outputs(batch["input_ids"], batch["features"], anchors, keep)
        h = model.train_hidden(batch["input_ids"], batch["features"], anchors, keep)
    assert logits.shape == (2, 2, K, V) and conf.shape == (2, 2, K) and emb.shape == (2, 2, K, 8)
    # Row 0, anchor 6, slot 2 follows gold token 8 of the row.
    prev = batch["input_ids"][0, 8]
    bias = model.markov_head.markov_w2.weight @ model.markov_head.markov_w1.weight[prev]
    torch.testing.assert_close(logits[0, 1, 2], model.lm_head(h[0, 1, 2]) + bias)


def _decode_hidden(model: DSparkDrafter, batch: dict, row: int, a: int) -> torch.Tensor:
    """The block at anchor `a` as decoding computes it: context taps < a only, decode masks."""
    ctx_pos = torch.arange(a)
    ctx_kv = model.context_kv(model.context(batch["features"][row : row + 1, :a]), ctx_pos)
    pos = torch.arange(a, a + K)
    ids = torch.full((1, K), model.spec.mask_token_id)
    ids[0, 0] = batch["input_ids"][row, a]
    return model.blocks(ids, pos[None], ctx_kv, model.decode_masks(ctx_pos, pos))[0]


@pytest.mark.parametrize("draft_vocab_size", [None, 24], ids=["full", "pruned"])
def test_training_outputs_equal_decoding_when_the_gold_tokens_are_the_drafts(draft_vocab_size):
    model = dspark_drafter(draft_vocab_size=draft_vocab_size)
    if draft_vocab_size:
        model.d2t.copy_(ODD_D2T)
        model.t2d.copy_(ODD_T2D)
    batch, row, a = dspark_batch(), 1, 5
    with torch.no_grad():
        block = draft_block(model, _decode_hidden(model, batch, row, a), batch["input_ids"][row, a])
        # Teacher forcing on a sequence whose continuation is the drafter's own proposals conditions every slot
        # on exactly the previous token decoding used, so every slot's logits and confidence must agree.
        ids = batch["input_ids"].clone()
        ids[row, a + 1 : a + 1 + K] = block.tokens
        anchors, keep = torch.tensor([[2], [a]]), torch.ones(2, 1, dtype=torch.bool)
        logits, conf, _ = model.train_outputs(ids, batch["features"], anchors, keep)
    torch.testing.assert_close(logits[row, 0], block.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.sigmoid(conf[row, 0]), block.confidence, atol=1e-6, rtol=1e-5)
    assert torch.equal(model.to_target(logits[row, 0].argmax(-1)), block.tokens)
    assert torch.equal(propose(model, _decode_hidden(model, batch, row, a), ids[row, a]), block.tokens)
    if draft_vocab_size:
        assert bool(ODD_T2D[block.tokens].all())  # drafts come back as target ids of kept tokens


@pytest.mark.parametrize("partial_blocks", [True, False], ids=["partial", "whole"])
def test_objective_equals_the_block_form_loss(partial_blocks):
    model = dspark_drafter()
    batch = dspark_batch()
    head = torch.randn(V, HT, generator=torch.Generator().manual_seed(3))
    out = dspark_objective(
        model,
        batch,
        target_head_VH=head,
        generator=torch.Generator().manual_seed(7),
        num_anchors=3,
        partial_blocks=partial_blocks,
    )
    # The same anchors, through the whole-block path: train_outputs on every slot, p_t at label - 1.
    from draftsmith.drafters.anchors import uniform_anchors

    depth = 2 if partial_blocks else K + 1
    anchors, keep = uniform_anchors(batch["loss_mask"], 3, torch.Generator().manual_seed(7), depth=depth)
    with torch.no_grad():
        logits, conf, _ = model.train_outputs(batch["input_ids"], batch["features"], anchors, keep)
    labels, valid = slot_labels(batch["input_ids"], batch["loss_mask"], anchors, keep, K, predict_anchor=True)
    pos = (anchors[:, :, None] + torch.arange(K)).clamp(max=batch["input_ids"].shape[1] - 1)
    lh = batch["last_hidden"][torch.arange(2)[:, None, None], pos]
    ref = dspark_loss(logits, conf, target_logp(head, lh), labels, valid, slot_weights(K, 4.0, True))
    assert float(out.total.detach()) == pytest.approx(float(ref.total), abs=1e-5)
    assert out.step_count.tolist() == ref.step_count.tolist()
    assert int(out.step_count.sum()) > 0 and torch.isfinite(out.total)


def test_objective_trains_the_heads_and_not_the_frozen_target_parts():
    model = dspark_drafter()
    head = torch.randn(V, HT)
    out = dspark_objective(
        model, dspark_batch(), target_head_VH=head, generator=torch.Generator().manual_seed(0), num_anchors=4
    )
    out.total.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    for name in ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight"):
        grad = grads[name]
        assert grad is not None and torch.count_nonzero(grad) > 0, name
    assert grads["fc.weight"] is not None and torch.count_nonzero(grads["fc.weight"]) > 0
    # The shared target embedding and lm_head stay frozen without a pruned vocabulary.
    assert grads["embed_tokens.weight"] is None and grads["lm_head.weight"] is None


def test_pruned_vocabulary_invalidates_undraftable_labels():
    model = dspark_drafter(draft_vocab_size=24)
    model.d2t.copy_(ODD_D2T)
    model.t2d.copy_(ODD_T2D)
    # Draft ids: 0, 1, 2, 3, 4, 5, 6, 7, 9, 11, ... (0-6 and every odd id); target 9 is draft 8, 39 is draft 23.
    labels = torch.tensor([[[3, 30, 9, 39]]])
    out_labels, valid = output_labels(model, labels, torch.ones(1, 1, 4, dtype=torch.bool))
    assert valid.tolist() == [[[True, False, True, True]]]
    assert out_labels[valid].tolist() == [3, 8, 23]


def test_speculative_decoding_equals_greedy_with_rollback_on_a_small_vocabulary():
    """A 12-token target, so the random drafter is sometimes right: acceptance and rollback both happen."""

    from draftsmith.drafters.dflash.decode import speculative_generate
    from draftsmith.drafters.eagle3.decode import greedy_generate

    target = small_llama(12, 24, seed=0)
    drafter = random_dspark(12, 24, seed=3, draft_vocab_size=8)
    drafter.d2t.copy_(torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]))  # target ids 0 1 3 4 6 7 9 10
    drafter.t2d.zero_()
    drafter.t2d[torch.arange(8) + drafter.d2t] = True
    with torch.no_grad():
        # This target's greedy text is mostly runs of token 10 broken by 6s. A learnt bigram "after 10 (or the
        # anchor 9) comes 10" in the Markov head makes whole blocks of 10s: long accepts, and rejections at the 6s.
        drafter.markov_head.markov_w1.weight.zero_()
        drafter.markov_head.markov_w1.weight[[9, 10], 0] = 1.0
        drafter.markov_head.markov_w2.weight.zero_()
        drafter.markov_head.markov_w2.weight[7, 0] = 100.0  # draft id 7 is target id 10
    g = torch.Generator().manual_seed(0)
    rounds = accepted = 0
    for _ in range(3):
        prompt = torch.randint(0, 12, (6,), generator=g)
        base = greedy_generate(target, prompt, max_new=20, eos=set())
        got = speculative_generate(target, drafter, TAPS3, prompt, max_new=20, eos=set(), propose=propose)
        assert got.tokens == base.tokens
        rounds, accepted = rounds + got.rounds, accepted + got.accepted
    assert 0 < accepted < K * rounds, (accepted, rounds)  # every slot drafts: up to K accepted per round


@torch.no_grad()
def test_decoding_on_the_tiny_target_equals_greedy_and_matches_training_heads():
    """On the tiny target, DSpark decoding is the target's greedy output, and every round's drafts come from the
    logits `heads` gives at training time for the same block and the same previous tokens."""
    from transformers import AutoModelForCausalLM

    from draftsmith.core.target_setup import ensure_tiny_target
    from draftsmith.drafters.dflash.decode import speculative_generate
    from draftsmith.drafters.eagle3.decode import greedy_generate
    from draftsmith.engines.hf import TapRecorder

    target = AutoModelForCausalLM.from_pretrained(ensure_tiny_target(), dtype=torch.float32).eval()
    vocab, ht = target.config.vocab_size, target.config.hidden_size
    drafter = random_dspark(vocab, ht, seed=5)
    prompt = torch.randint(0, 1000, (9,), generator=torch.Generator().manual_seed(2))
    base = greedy_generate(target, prompt, max_new=24, eos=set())
    seen: list[tuple[int, DraftBlock]] = []

    def recording(d, h_QH, anchor):
        block = draft_block(d, h_QH, anchor)
        seen.append((int(anchor), block))
        return block.tokens

    got = speculative_generate(target, drafter, TAPS3, prompt, max_new=24, eos=set(), propose=recording)
    assert got.tokens == base.tokens
    full = torch.cat([prompt, torch.tensor(base.tokens)])
    with TapRecorder(target, TAPS3) as rec:
        target(input_ids=full[None])
    # Round r's anchor sits where the text verified so far ends.
    pos, anchors = prompt.numel(), []
    for r in range(got.rounds):
        assert int(full[pos]) == seen[r][0]
        anchors.append(pos)
        accepted = next((i for i, t in enumerate(seen[r][1].tokens.tolist()) if t != int(full[pos + 1 + i])), K)
        pos += accepted + 1
    a = torch.tensor([anchors])
    h = drafter.train_hidden(full[None], rec.features_BSF().float(), a, torch.ones_like(a).bool())
    for r, (anchor, block) in enumerate(seen):
        prev = torch.cat([torch.tensor([anchor]), block.tokens[:-1]])  # the drafter's own previous choices
        logits, conf, _ = drafter.heads(h[0, r], prev)
        torch.testing.assert_close(logits, block.logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(torch.sigmoid(conf), block.confidence, atol=1e-5, rtol=1e-4)
