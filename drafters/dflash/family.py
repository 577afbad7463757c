"""DFlash2 as a drafter family (`draftsmith.drafters.families`); `block_spec`/`init_block` are shared with DSpark.

Shape legend: V target vocabulary, Ht target width.
"""

import functools
from typing import TypeVar

import torch

from draftsmith import kernels
from draftsmith.core.config import DFlash2Config, DSparkConfig
from draftsmith.drafters import families, vocab
from draftsmith.drafters.dflash import decode, export
from draftsmith.drafters.dflash.loss import dflash_objective
from draftsmith.drafters.dflash.model import DFlashDrafter
from draftsmith.drafters.dflash.spec import DFlashSpec


def block_spec(cfg: DFlash2Config | DSparkConfig, inputs: families.BuildInputs) -> dict:
    """`DFlashSpec` fields common to the block drafters, from the recipe and the target's config."""
    config, H = inputs.target_model.config, inputs.target.hidden_size
    return {
        "hidden_size": H,
        "target_hidden_size": H,
        "num_taps": inputs.num_taps,
        "num_layers": cfg.num_layers,
        "num_heads": cfg.num_heads,
        "num_kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": inputs.target.vocab_size,
        "block_size": cfg.block_size,
        "mask_token_id": cfg.mask_token_id,
        "layer_types": tuple(cfg.layer_types or ()),
        "sliding_window": cfg.sliding_window,
        "attention": cfg.attention,
        "mla": cfg.mla.model_dump() if cfg.mla else None,
        "rope_theta": families.rope_theta(config),
        "rope_scaling": families.rope_scaling(config),
        "rms_norm_eps": families.rms_norm_eps(config),
        "fc_norm": cfg.fc_norm,
        "draft_vocab_size": cfg.draft_vocab_size,
    }


D = TypeVar("D", bound=DFlashDrafter)


def init_block(drafter: D, inputs: families.BuildInputs) -> D:
    """Copy the target's embedding (frozen) and lm_head: shared and frozen, or the pruned rows, trainable."""
    model = inputs.target_model
    families.copy_frozen(drafter.embed_tokens, families.weight_of(model.get_input_embeddings()))
    head = model.get_output_embeddings().weight.detach().float()
    if drafter.spec.draft_vocab_size is None:
        families.copy_frozen(drafter.lm_head, head)
        return drafter
    d2t, t2d = vocab.build_draft_vocab(inputs.counts_V, drafter.spec.draft_vocab_size)
    drafter.d2t.copy_(d2t)
    drafter.t2d.copy_(t2d)
    with torch.no_grad():
        # Start from the target's own rows: the head then predicts the target's next token from step 0.
        drafter.lm_head.weight.copy_(head[vocab.draft_ids(d2t)])
    return drafter


def build(cfg: DFlash2Config, inputs: families.BuildInputs) -> DFlashDrafter:
    spec = DFlashSpec(
        **block_spec(cfg, inputs),
        conv_kernel_size=cfg.conv_kernel_size,
        conv_group_size=cfg.conv_group_size,
        selector_rank=cfg.selector_rank,
        selector_top_k=cfg.selector_top_k,
    )
    return init_block(DFlashDrafter(spec), inputs)


def objective(cfg: DFlash2Config, model: DFlashDrafter, head_VHt: torch.Tensor, generator: torch.Generator):
    """CE on the corpus tokens over each block's contiguous supervised prefix, plus the selector's K-way CE."""
    return functools.partial(
        dflash_objective,
        target_head_VH=head_VHt,
        generator=generator,
        num_anchors=cfg.num_anchors,
        gamma=cfg.gamma,
        selector_alpha=cfg.selector_alpha,
    )


def checkpoint_blobs(model: DFlashDrafter, taps: list[int], metadata: dict) -> dict[str, bytes]:
    return export.checkpoint_blobs(model, taps, metadata)


def load(folder: str, target_model) -> tuple[DFlashDrafter, list[int]]:
    return export.load_drafter(folder, *shared_weights(target_model))


def shared_weights(target_model) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's embedding `[V, Ht]` and lm_head `[V, Ht]`, fp32."""
    embed = target_model.get_input_embeddings().weight.detach().float()
    return embed, target_model.get_output_embeddings().weight.detach().float()


def generate(
    target, drafter: DFlashDrafter, taps: list[int], prompt_S: torch.Tensor, *, g: int, max_new: int, eos, **how
):
    """Drafts the block's B - 1 mask slots each round (`g` is fixed by the block size); `how`: sampling, rule,
    generator."""
    how.pop("truncate", None)
    return decode.speculative_generate(target, drafter, taps, prompt_S, max_new=max_new, eos=eos, **how)


def proposer(drafter: DFlashDrafter, g: int) -> decode.BlockProposer:
    """One row's drafting state for `draftsmith.drafters.speculative_batch` (its block decides g)."""
    return decode.BlockProposer(drafter)


def code_modules() -> list:
    """Modules whose source decides what training and decoding produce (cache keys)."""
    import draftsmith.drafters.dflash as pkg
    from draftsmith.drafters import anchors, layers, masks, mla

    return [anchors, layers, masks, mla, vocab, *package_modules(pkg), *kernels.source_modules()]


def package_modules(pkg) -> list:
    import importlib
    import pkgutil

    return [importlib.import_module(f"{pkg.__name__}.{m.name}") for m in pkgutil.iter_modules(pkg.__path__)]
