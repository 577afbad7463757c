"""The DSpark drafter: the DFlash block backbone with every slot predicting (`predict_anchor`), plus a Markov
head (low-rank bigram bias on the previous token) and a confidence head (arXiv 2607.05147, algorithms.md §1(c)).

Parameter names are the ones vLLM's `Qwen3DSparkModel` loads: the backbone's, plus `markov_head.markov_w1/w2`
and `confidence_head.proj` (weight and bias). The Markov head embeds *target* ids (vLLM feeds it the previous
sampled token after the draft-to-target map, and the anchor) and biases the output (draft) vocabulary.

Shape legend: B batch, S sequence, F feature width, H drafter width, Ht target width, N anchors, K block
slots (= block_size), V target vocabulary, Vout output vocabulary, r Markov rank, n counted rows.
"""

from dataclasses import dataclass

import torch

from draftsmith.drafters.anchors import uniform_anchors
from draftsmith.drafters.dflash.loss import slot_labels, slot_weights
from draftsmith.drafters.dflash.model import DFlashDrafter
from draftsmith.drafters.dflash.spec import DFlashSpec
from draftsmith.drafters.dspark.heads import ConfidenceHead, FullVocabHead, MarkovHead
from draftsmith.drafters.dspark.loss import DEFAULT_MIX, dspark_rows_fused, outside_logsumexp
from draftsmith.drafters.objective import StepLoss
from draftsmith.drafters.vocab import draft_ids, target_to_draft
from draftsmith.kernels import Target


@dataclass(frozen=True)
class DSparkSpec(DFlashSpec):
    """A DFlash spec whose anchor slot predicts too, plus the DSpark heads' switches (vLLM config names)."""

    predict_anchor: bool = True
    markov_rank: int = 256
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.predict_anchor:
            raise ValueError("dspark.predict_anchor: DSpark's anchor slot is a prediction; it must be true")
        if self.markov_rank < 1:
            raise ValueError(f"dspark.markov_rank: must be at least 1, got {self.markov_rank}")
        if self.selector_rank or self.conv_kernel_size:
            raise ValueError("dspark: the DFlash2 selector and convs are not part of DSpark (vLLM loads neither)")


TARGET_VOCABS = ("full", "draft")


class DSparkDrafter(DFlashDrafter):
    """DFlash backbone + `markov_head` + optional `confidence_head`; a pruned lm_head is a `FullVocabHead`."""

    spec: DSparkSpec

    def __init__(self, spec: DSparkSpec) -> None:
        if not isinstance(spec, DSparkSpec):
            raise ValueError(f"DSparkDrafter: expected a DSparkSpec, got {type(spec).__name__}")
        super().__init__(spec)
        if spec.draft_vocab_size is not None:
            head = FullVocabHead(spec.hidden_size, spec.draft_vocab_size)
            head.weight = self.lm_head.weight
            self.lm_head = head
        out_vocab = spec.draft_vocab_size or spec.vocab_size
        self.markov_head = MarkovHead(spec.vocab_size, out_vocab, spec.markov_rank)
        if spec.enable_confidence_head:
            self.confidence_head = ConfidenceHead(spec.hidden_size, spec.markov_rank, spec.confidence_head_with_markov)

    def heads(self, h: torch.Tensor, prev_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(logits [..., Vout], conf_logit [...], markov_emb [..., r])` from backbone outputs `h` `[..., H]`
        (after the final norm) and each slot's previous token as a target id `[...]`.

        logits = backbone logits + Markov bias; the confidence logit is zeros without a confidence head.
        """
        emb = self.markov_head.embed(prev_ids)
        logits = self.logits(h) + self.markov_head.project(emb)
        if self.spec.enable_confidence_head:
            conf = self.confidence_head(h, emb)
        else:
            conf = torch.zeros(h.shape[:-1], dtype=torch.float32, device=h.device)
        return logits, conf, emb

    def prev_tokens(self, input_ids_BS: torch.Tensor, anchors_BN: torch.Tensor) -> torch.Tensor:
        """Teacher-forced previous tokens `[B, N, K]`: `[anchor, gold_1, ..., gold_{K-1}]`, i.e. token a + k.

        Positions past the sequence end are clamped; those slots are never valid (`slot_labels`).
        """
        S = input_ids_BS.shape[1]
        pos = anchors_BN[:, :, None] + torch.arange(self.spec.block_size, device=anchors_BN.device)
        return input_ids_BS.gather(1, pos.clamp(max=S - 1).flatten(1)).view_as(pos)

    def train_outputs(
        self, input_ids_BS: torch.Tensor, features_BSF: torch.Tensor, anchors_BN: torch.Tensor, keep_BN: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(logits [B, N, K, Vout], conf_logit [B, N, K], markov_emb [B, N, K, r])` for every anchor's block.

        The Markov bias of all slots is one vectorised add on teacher-forced previous tokens; at decode time the
        same bias is applied slot by slot to the drafter's own previous choice (`decode.propose`).
        """
        h = self.train_hidden(input_ids_BS, features_BSF, anchors_BN, keep_BN)
        return self.heads(h, self.prev_tokens(input_ids_BS, anchors_BN))


def output_labels(model: DSparkDrafter, labels: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Target-id labels -> output-vocabulary labels; with a pruned vocabulary, undraftable labels are invalid."""
    if model.spec.draft_vocab_size is None:
        return labels, valid
    index = target_to_draft(model.t2d).to(labels.device)[labels]
    return index.clamp(min=0), valid & (index >= 0)


def dspark_objective(
    model: DSparkDrafter,
    batch: dict,
    *,
    target_head_VH: torch.Tensor,
    generator: torch.Generator,
    num_anchors: int,
    gamma: float = 4.0,
    mix: tuple[float, float, float] = DEFAULT_MIX,
    partial_blocks: bool = True,
    target_vocab: str = "full",
) -> StepLoss:
    """One DSpark training step's loss over `batch` (`draftsmith.drafters.data.collate`: input_ids, loss_mask, features,
    last_hidden).

    Slot k of the block at a predicts token a + k + 1 with weight exp(-k / gamma); p_t for that slot is the
    frozen target head `target_head_VH` `[V, Ht]` on the target's post-norm state at a + k (T = 1). Only counted
    rows reach the `[n, Vout]` logits. Without a confidence head its BCE term is dropped from the mix.

    Args:
        partial_blocks: anchors at every supervised position whose next token is supervised, slots past the row
            end left uncounted (DeepSpec); False: only anchors whose whole block lies inside the row.
        target_vocab: with a pruned vocabulary, p_t over the whole target vocabulary (`"full"`, the paper's) or
            renormalised over the draft ids (`"draft"`); the same without pruning.
    """
    if "last_hidden" not in batch:
        raise ValueError("dspark_objective: batch has no 'last_hidden' (store the target's last hidden state)")
    if target_vocab not in TARGET_VOCABS:
        raise ValueError(f"dspark_objective: target_vocab must be one of {TARGET_VOCABS}, got {target_vocab!r}")
    spec = model.spec
    K = spec.block_size
    ids, mask = batch["input_ids"], batch["loss_mask"]
    # depth 2: the anchor and its first label supervised (`candidates`); K + 1: the whole block inside the row.
    anchors, keep = uniform_anchors(mask, num_anchors, generator, depth=2 if partial_blocks else K + 1)
    anchors, keep = anchors.to(ids.device), keep.to(ids.device)
    h = model.train_hidden(ids, batch["features"], anchors, keep)
    labels, valid = slot_labels(ids, mask, anchors, keep, K, predict_anchor=True)
    labels, valid = output_labels(model, labels, valid)
    b, n, k = valid.nonzero(as_tuple=True)
    pos = anchors[b, n] + k  # position of each counted slot's previous token (= label position - 1)
    kept_ids = None if spec.draft_vocab_size is None else draft_ids(model.d2t)
    head = target_head_VH.to(h.device)
    hidden = batch["last_hidden"][b, pos].to(h.device)
    target = Target(hidden=hidden, head=head if kept_ids is None else head[kept_ids])
    outside = None
    if kept_ids is not None and target_vocab == "full":
        # A position is the previous token of several counted slots (overlapping blocks): its [V]-wide logits
        # are made once.
        where, again = (b * ids.shape[1] + pos).unique(return_inverse=True)
        last = batch["last_hidden"].flatten(0, 1)[where].to(h.device)
        outside = outside_logsumexp(last, head, model.t2d)[again.to(h.device)]
    if not spec.enable_confidence_head:
        mix = (mix[0], mix[1], 0.0)
    return dspark_rows_fused(
        model, h[b, n, k], ids[b, pos], target, labels[b, n, k], k, slot_weights(K, gamma, True), mix, outside
    )
