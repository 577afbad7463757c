"""The only target weights a trainer needs: its input embedding and lm_head (and any layer a drafter starts
from), read from the safetensors alone.

Building a drafter reads the target's config, embedding and lm_head (`draftsmith.drafters.families.BuildInputs`). A
Kimi K3 target is a terabyte, so the trainer never loads it: the model is laid out on the meta device and
just those two tensors are read from the checkpoint files (one tensor when the head is tied).

Shape legend: V target vocabulary, Ht target width.
"""

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from draftsmith.core.config import TargetConfig
from draftsmith.core.target_setup import resolve_target


def _weight_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it (sharded or single-file checkpoints)."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return {k: folder / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    single = folder / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"target.source: {folder} has neither model.safetensors nor its index")
    with safe_open(str(single), "pt") as f:
        return dict.fromkeys(f.keys(), single)


def _read(files: dict[str, Path], names: list[str], folder: Path) -> torch.Tensor:
    for name in names:
        if name in files:
            with safe_open(str(files[name]), "pt") as f:
                return f.get_tensor(name)
    raise KeyError(f"target.source: {folder} holds none of {names}")


def _param_name(model: PreTrainedModel, module: torch.nn.Module) -> str:
    return next(f"{n}.weight" for n, m in model.named_modules() if m is module)


def _read_modules(model: PreTrainedModel, files: dict[str, Path], names: Sequence[str], folder: Path) -> None:
    """Replace the meta parameters of each named module with the checkpoint's (CPU, fp32, frozen)."""
    for name in names:
        module = model.get_submodule(name)
        for pname, _ in list(module.named_parameters(recurse=True)):
            owner, _, leaf = f"{name}.{pname}".rpartition(".")
            tensor = _read(files, [f"{name}.{pname}"], folder).float()
            setattr(model.get_submodule(owner), leaf, torch.nn.Parameter(tensor, requires_grad=False))


def load_target_parts(target: TargetConfig, *, materialize: bool, modules: Sequence[str] = ()) -> PreTrainedModel:
    """The target laid out on the meta device; with `materialize`, its embedding and head are real (CPU, fp32),
    and so are the `modules` (HF names, e.g. `model.layers.29`) a drafter starts from.

    Without `materialize` everything stays on meta: what a rank that receives its shards by broadcast
    needs to build the drafter's meta skeleton.
    """
    folder = resolve_target(target.source)
    config = AutoConfig.from_pretrained(folder, trust_remote_code=target.trust_remote_code)
    declared = (target.num_layers, target.hidden_size, target.vocab_size)
    actual = (config.num_hidden_layers, config.hidden_size, config.vocab_size)
    if declared != actual:
        raise ValueError(
            f"target: the recipe declares (num_layers, hidden_size, vocab_size)={declared}; {folder} has {actual}"
        )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=target.trust_remote_code)
    if not materialize:
        return model
    files = _weight_files(Path(folder))
    embed_mod, head_mod = model.get_input_embeddings(), model.get_output_embeddings()
    embed_name = _param_name(model, embed_mod)
    embed = _read(files, [embed_name], Path(folder)).float()
    tied = getattr(config, "tie_word_embeddings", False)
    head = embed if tied else _read(files, [_param_name(model, head_mod)], Path(folder)).float()
    embed_mod.weight = torch.nn.Parameter(embed, requires_grad=False)
    head_mod.weight = embed_mod.weight if tied else torch.nn.Parameter(head, requires_grad=False)
    _read_modules(model, files, modules, Path(folder))
    return model


def target_head(target_model: PreTrainedModel) -> torch.Tensor:
    """The target's lm_head weight `[V, Ht]` (fp32), which every objective scores the target with."""
    return target_model.get_output_embeddings().weight.detach().float()
