"""EAGLE-3 as a drafter family (`draftsmith.drafters.families`): build, objective (dense or anchored TTT), decoding.

Shape legend: B batch, S sequence, V target vocabulary, Vd draft vocabulary, Ht target width.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from draftsmith import kernels
from draftsmith.core.config import Eagle3Config
from draftsmith.drafters import anchors, families, vocab
from draftsmith.drafters.eagle3 import anchored, decode, export, loss, noise, target, target_init
from draftsmith.drafters.eagle3.model import Eagle3Drafter, Eagle3Spec
from draftsmith.drafters.objective import StepLoss


def build(cfg: Eagle3Config, inputs: families.BuildInputs) -> Eagle3Drafter:
    """A fresh drafter with the target's frozen embedding and a vocabulary pruned by the loss-token counts."""
    config, H = inputs.target_model.config, inputs.target.hidden_size
    spec = Eagle3Spec(
        hidden_size=H,
        target_hidden_size=H,
        num_taps=inputs.num_taps,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        intermediate_size=cfg.intermediate_size,
        vocab_size=inputs.target.vocab_size,
        draft_vocab_size=cfg.draft_vocab_size,
        rope_theta=families.rope_theta(config),
        rope_scaling=families.rope_scaling(config),
        rms_norm_eps=families.rms_norm_eps(config),
        fc_norm=cfg.fc_norm,
        norm_output=cfg.norm_output,
        attention=cfg.attention,
        mla=cfg.mla.model_dump() if cfg.mla else None,
    )
    drafter = Eagle3Drafter(spec)
    d2t, t2d = vocab.build_draft_vocab(inputs.counts_V, cfg.draft_vocab_size)
    drafter.d2t.copy_(d2t)
    drafter.t2d.copy_(t2d)
    families.copy_frozen(drafter.embed_tokens, families.weight_of(inputs.target_model.get_input_embeddings()))
    if cfg.init_lm_head_from_target:
        # The draft head predicts the same next-token distribution as the target's; starting there
        # instead of at random saves most of the early steps on a small corpus.
        head = inputs.target_model.get_output_embeddings().weight.detach().float()
        with torch.no_grad():
            drafter.lm_head.weight.copy_(head[vocab.draft_ids(d2t)])
    if cfg.init_layer_from_target is not None:
        target_init.init_from_target_layer(
            drafter, inputs.target_model, cfg.init_layer_from_target, cfg.init_fc_last_tap
        )
    if cfg.freeze_lm_head:
        drafter.lm_head.weight.requires_grad_(False)
    return drafter


@torch.no_grad()
def draftable(batch: dict[str, torch.Tensor], head_VHt: torch.Tensor, t2d_V: torch.Tensor) -> torch.Tensor:
    """`[B, S]`: is the target's full-vocabulary argmax at p in the draft vocabulary? (No draft could match
    a token outside it.) Only positions followed by a loss token can count, so only those pay for `[*, V]`."""
    needed = torch.zeros_like(batch["loss_mask"])
    needed[:, :-1] = batch["loss_mask"][:, 1:]
    out = torch.zeros_like(needed)
    if needed.any():
        out[needed] = t2d_V[(batch["last_hidden"][needed] @ head_VHt.T).argmax(-1)]
    return out


@dataclass(frozen=True)
class Objective:
    """The step loss, called as `objective(model, batch)`, with the shared target it reads (None when off): its
    per-sample cache, for benchmarks that time a first epoch."""

    loss: Callable[[Eagle3Drafter, dict[str, torch.Tensor]], StepLoss]
    shared_target: target.SharedTarget | None

    def __call__(self, model: Eagle3Drafter, batch: dict[str, torch.Tensor]) -> StepLoss:
        return self.loss(model, batch)


def objective(
    cfg: Eagle3Config,
    model: Eagle3Drafter,
    head_VHt: torch.Tensor,
    generator: torch.Generator,
    *,
    shared: bool | None = None,
) -> Objective:
    """Forward KL to the target at every TTT depth; anchored TTT when `cfg.anchored` is set.

    `shared` (default: off CUDA, `target.use_shared_target`): the counted positions and the target's
    draft-vocabulary logits come from `target.SharedTarget`, once per step; otherwise from `draftable` and
    the fused kernel's per-depth target logits. Both give the same loss (tested).
    """
    draft_head = head_VHt[vocab.draft_ids(model.d2t)]  # [Vd, Ht], in the training compute dtype
    shared_target = None
    if shared if shared is not None else target.use_shared_target(head_VHt):
        shared_target = target.SharedTarget(head_VHt, model.d2t, model.t2d)

    def run(model: Eagle3Drafter, batch: dict[str, torch.Tensor]) -> StepLoss:
        target_logits = None
        if shared_target is not None:
            mask, target_logits = shared_target(batch["loss_mask"], batch["last_hidden"])
        else:
            mask = loss.position_mask(batch["loss_mask"], draftable(batch, head_VHt, model.t2d))
        ids = batch["input_ids"]
        feats = noise.feature_noise(batch["features"], model.spec.num_taps, cfg.feature_noise, generator)
        if cfg.anchored is not None:
            a = cfg.anchored
            anchor_BN, keep_BN = anchors.strided_anchors(
                batch["loss_mask"], a.num_anchors, cfg.ttt_depth, a.max_gap, generator
            )
            hidden = anchored.anchored_hidden(model, ids, feats, anchor_BN, keep_BN, cfg.ttt_depth)
            return anchored.anchored_loss_fused(
                model,
                hidden,
                anchor_BN,
                keep_BN,
                batch["last_hidden"],
                draft_head,
                mask,
                cfg.depth_decay,
                target_logits,
            )
        hidden = model.ttt_hidden(ids, feats, cfg.ttt_depth)
        if target_logits is not None:
            return loss.ttt_loss_shared(model, hidden, target_logits, mask, cfg.depth_decay)
        return loss.ttt_loss_fused(model, hidden, batch["last_hidden"][mask], draft_head, mask, cfg.depth_decay)

    return Objective(run, shared_target)


def generate(
    target, drafter: Eagle3Drafter, taps: list[int], prompt_S: torch.Tensor, *, g: int, max_new: int, eos, **how
):
    """A chain of `g` drafts per round; `how`: sampling, rule, generator (see `draftsmith.drafters.speculative`)."""
    how.pop("truncate", None)  # a chain has no confidences to truncate by
    return decode.speculative_generate(target, drafter, taps, prompt_S, g=g, max_new=max_new, eos=eos, **how)


def proposer(drafter: Eagle3Drafter, g: int) -> decode.EagleProposer:
    """One row's drafting state for `draftsmith.drafters.speculative_batch` (a chain of `g`)."""
    return decode.EagleProposer(drafter, g)


def checkpoint_blobs(model: Eagle3Drafter, taps: list[int], metadata: dict) -> dict[str, bytes]:
    return export.checkpoint_blobs(model, taps, metadata)


def load(folder: str, target_model) -> tuple[Eagle3Drafter, list[int]]:
    return export.load_drafter(folder, target_model.get_input_embeddings().weight.float())


def code_modules() -> list:
    """Modules whose source decides what training and decoding produce (cache keys)."""
    from draftsmith.drafters import layers, masks, mla
    from draftsmith.drafters.eagle3 import attention, chain_attention
    from draftsmith.drafters.eagle3 import model as eagle3_model

    modules = [
        anchors,
        anchored,
        decode,
        export,
        loss,
        noise,
        target,
        eagle3_model,
        attention,
        chain_attention,
        vocab,
        layers,
        masks,
        mla,
    ]
    return [*modules, *kernels.source_modules()]
