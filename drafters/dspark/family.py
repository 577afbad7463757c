"""DSpark as a drafter family (`drafters.families`): the DFlash backbone plus its Markov and confidence heads."""

import functools

import torch

from draftsmith.core.config import DSparkConfig
from draftsmith.drafters import families
from draftsmith.drafters.dflash import decode as block_decode
from draftsmith.drafters.dflash import family as dflash_family
from draftsmith.drafters.dspark import decode, export
from draftsmith.drafters.dspark.heads import normal_init
from draftsmith.drafters.dspark.model import DSparkDrafter, DSparkSpec, dspark_objective


def build(cfg: DSparkConfig, inputs: families.BuildInputs) -> DSparkDrafter:
    spec = DSparkSpec(
        **dflash_family.block_spec(cfg, inputs),
        markov_rank=cfg.markov_rank,
        enable_confidence_head=cfg.confidence_head,
    )
    drafter = DSparkDrafter(spec)
    if cfg.init_std is not None:
        normal_init(drafter, cfg.init_std)
    return dflash_family.init_block(drafter, inputs)


def objective(cfg: DSparkConfig, model: DSparkDrafter, head_VHt: torch.Tensor, generator: torch.Generator):
    """`0.1 CE + 0.9 L1 + 1.0 BCE` (the recipe's `loss_weights`) against the target's own distribution, with the
    recipe's anchor and target-vocabulary choices (`partial_blocks`, `target_vocab`)."""
    return functools.partial(
        dspark_objective,
        target_head_VH=head_VHt,
        generator=generator,
        num_anchors=cfg.num_anchors,
        gamma=cfg.gamma,
        mix=cfg.loss_weights,
        partial_blocks=cfg.partial_blocks,
        target_vocab=cfg.target_vocab,
    )


def checkpoint_blobs(model: DSparkDrafter, taps: list[int], metadata: dict) -> dict[str, bytes]:
    return export.checkpoint_blobs(model, taps, metadata)


def load(folder: str, target_model) -> tuple[DSparkDrafter, list[int]]:
    return export.load_drafter(folder, *dflash_family.shared_weights(target_model))


def generate(
    target, drafter: DSparkDrafter, taps: list[int], prompt_S: torch.Tensor, *, g: int, max_new: int, eos, **how
):
    """Every slot drafts (B per round), each from backbone logits plus the previous draft's Markov bias (sampled
    sequentially when sampling); `how`: sampling, rule, generator, truncate (dynamic verification)."""
    return block_decode.speculative_generate(
        target, drafter, taps, prompt_S, max_new=max_new, eos=eos, pick=decode.pick, **how
    )


def proposer(drafter: DSparkDrafter, g: int) -> block_decode.BlockProposer:
    """One row's drafting state for `draftsmith.drafters.speculative_batch`: blocks picked with the Markov bias."""
    return block_decode.BlockProposer(drafter, decode.pick)


def code_modules() -> list:
    import draftsmith.drafters.dspark as pkg

    return dflash_family.code_modules() + dflash_family.package_modules(pkg)
