"""Starting the EAGLE-3 draft layer from a target decoder layer instead of at random.

The draft layer has a Llama layer's shapes except that q/k/v read `[norm(embed); norm(hidden)]`, twice the
target width. A target layer reads one residual stream that carries both the token and its context, so each
projection starts as the target's on both halves, scaled by 1/sqrt(2) to keep the projected width's scale
when the halves are uncorrelated. The MLP, the two norms and `o_proj` are copied as they are; the output norm
starts from the target's final norm, which is what the target head (the draft head's initial rows) expects.
`fc_last_tap` also starts the fusion as the identity on the last tap, so the residual begins as the target's
own late feature rather than a random mixture of the three.
"""

import math
from typing import Any

import torch
from torch import nn

from draftsmith.drafters.eagle3.model import Eagle3Drafter

FIELD = "drafter.init_layer_from_target"


def _decoder(target_model: nn.Module) -> Any:
    """The target's Llama-style decoder (`model.layers`, `model.norm`): a Hugging Face module, typed by name only."""
    inner = getattr(target_model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "norm"):
        raise ValueError(f"{FIELD}: the target has no Llama-style model.layers / model.norm to copy from")
    return inner


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{FIELD}: {name} is {tuple(src.shape)} in the target, {tuple(dst.shape)} in the drafter")
    dst.copy_(src.float())


@torch.no_grad()
def init_from_target_layer(drafter: Eagle3Drafter, target_model: nn.Module, index: int, fc_last_tap: bool) -> None:
    """Overwrite the draft layer (and the output norm, and with `fc_last_tap` the fusion) from target layer `index`.

    Raises a ValueError naming `drafter.init_layer_from_target` when the layer does not exist or its shapes
    differ from the drafter's (MLA drafters, other widths).
    """
    if drafter.spec.attention != "gqa":
        raise ValueError(f"{FIELD}: only GQA draft layers can start from a target layer")
    decoder = _decoder(target_model)
    n = len(decoder.layers)
    if not -n <= index < n:
        raise ValueError(f"{FIELD}: {index} is not a layer of the {n}-layer target")
    src, dst = decoder.layers[index], drafter.midlayer
    for proj in ("q_proj", "k_proj", "v_proj"):
        w = getattr(src.self_attn, proj).weight
        _copy(getattr(dst.self_attn, proj).weight, torch.cat([w, w], dim=1) / math.sqrt(2), f"self_attn.{proj}")
    _copy(dst.self_attn.o_proj.weight, src.self_attn.o_proj.weight, "self_attn.o_proj")
    for proj in ("gate_proj", "up_proj", "down_proj"):
        _copy(getattr(dst.mlp, proj).weight, getattr(src.mlp, proj).weight, f"mlp.{proj}")
    for norm in (dst.input_layernorm, dst.hidden_norm):
        _copy(norm.weight, src.input_layernorm.weight, "input_layernorm")
    _copy(dst.post_attention_layernorm.weight, src.post_attention_layernorm.weight, "post_attention_layernorm")
    _copy(drafter.norm.weight, decoder.norm.weight, "norm")
    if fc_last_tap:
        H, Ht, N = drafter.spec.hidden_size, drafter.spec.target_hidden_size, drafter.spec.num_taps
        if H != Ht:
            raise ValueError(f"{FIELD}: fc_last_tap needs the drafter width ({H}) to equal the target's ({Ht})")
        drafter.fc.weight.zero_()
        drafter.fc.weight[:, (N - 1) * Ht :] = torch.eye(H, device=drafter.fc.weight.device)
