"""EAGLE-3 checkpoints in the format vLLM loads (`LlamaForCausalLMEagle3`), and back.

The frozen embedding is not saved: vLLM shares the target's, and so does `load_drafter`.
Weights are stored in bf16 (the serving dtype); d2t is int64, t2d bool.
"""

import json

import torch

from drafters.eagle3.model import Eagle3Drafter, Eagle3Spec
from drafters.vocab import check_vocab
from draftsmith import storage, tensorio

WEIGHTS = "model.safetensors"
CONFIG = "config.json"


def serving_config(spec: Eagle3Spec, taps: list[int], metadata: dict[str, str]) -> dict:
    """config.json for vLLM/SGLang `eagle3`; aux ids use the residual-after-layer-k convention."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "num_hidden_layers": 1,
        "vocab_size": spec.vocab_size,
        "draft_vocab_size": spec.draft_vocab_size,
        "target_hidden_size": spec.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(taps),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(taps), "use_aux_hidden_state": True},
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        **({"rope_scaling": spec.rope_scaling} if spec.rope_scaling else {}),
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "fc_norm": spec.fc_norm,
        "norm_output": spec.norm_output,
        "draftsmith": {"spec": spec.to_dict(), "taps": list(taps), **metadata},
    }


def checkpoint_blobs(model: Eagle3Drafter, taps: list[int], metadata: dict[str, str]) -> dict[str, bytes]:
    """`{file name: bytes}` of the checkpoint folder."""
    check_vocab(model.d2t, model.t2d)
    tensors = {}
    for name, value in model.state_dict().items():
        if name.startswith("embed_tokens."):
            continue
        tensors[name] = value.to(torch.bfloat16) if value.is_floating_point() else value
    config = serving_config(model.spec, taps, metadata)
    return {WEIGHTS: tensorio.dumps(tensors), CONFIG: (json.dumps(config, indent=2) + "\n").encode()}


def load_drafter(folder: str, embed_weight: torch.Tensor) -> tuple[Eagle3Drafter, list[int]]:
    """Rebuild the fp32 drafter and its taps from a checkpoint folder, sharing the target's embedding."""
    config = storage.read_json(storage.join(folder, CONFIG))
    spec = Eagle3Spec(**config["draftsmith"]["spec"])
    model = Eagle3Drafter(spec)
    tensors, _ = tensorio.loads(storage.read_bytes(storage.join(folder, WEIGHTS)))
    tensors["embed_tokens.weight"] = embed_weight
    missing, unexpected = model.load_state_dict(
        {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}, strict=False
    )
    if missing or unexpected:
        raise ValueError(f"{folder}: checkpoint keys do not match: missing {missing}, unexpected {unexpected}")
    check_vocab(model.d2t, model.t2d)
    model.eval()
    return model, list(config["eagle_aux_hidden_state_layer_ids"])
