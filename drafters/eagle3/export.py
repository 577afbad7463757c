"""EAGLE-3 checkpoints in the format vLLM, SGLang and TokenSpeed load (`LlamaForCausalLMEagle3`), and back.

The frozen embedding is not saved: the engines share the target's, and so does `load_drafter`.
Weights are stored in bf16 (the serving dtype); d2t is int64, t2d bool (vLLM ignores t2d; SGLang reads both).
Only the aux layer ids differ between engines (see `draftsmith.drafters.export.engines.aux_layer_ids`).
"""

import json

import torch

from draftsmith.core import storage, tensorio
from draftsmith.drafters.eagle3.attention import serving_fields
from draftsmith.drafters.eagle3.model import Eagle3Drafter, Eagle3Spec
from draftsmith.drafters.export import engines
from draftsmith.drafters.vocab import check_vocab

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
METHOD = "eagle3"


def serving_config(spec: Eagle3Spec, taps: list[int], metadata: dict, engine: str = "vllm") -> dict:
    """config.json for `eagle3` on `engine`; our taps (residual after layer k, from 1) stay in `draftsmith.taps`."""
    aux = engines.aux_layer_ids(METHOD, engine, taps)
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
        "eagle_aux_hidden_state_layer_ids": aux,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux, "use_aux_hidden_state": True},
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        **({"rope_scaling": spec.rope_scaling} if spec.rope_scaling else {}),
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "fc_norm": spec.fc_norm,
        "norm_output": spec.norm_output,
        # The MLA variant (eagle3.1-mla) is vLLM's `Eagle3DeepseekV3ForCausalLM`: its fields override the Llama ones.
        **serving_fields(spec),
        "draftsmith": {"spec": spec.to_dict(), "taps": list(taps), "engine": engine, **metadata},
    }


def pruned(spec: Eagle3Spec) -> bool:
    """Whether d2t/t2d are exported: vLLM has no `draft_id_to_target_id` for a full-vocabulary draft."""
    return spec.draft_vocab_size != spec.vocab_size


def serving_tensors(model: Eagle3Drafter) -> dict[str, torch.Tensor]:
    """The state dict without the shared embedding (and without the identity d2t/t2d), floats in bf16."""
    skip = {"embed_tokens.weight"} | (set() if pruned(model.spec) else {"d2t", "t2d"})
    tensors = {}
    for name, value in model.state_dict().items():
        if name in skip:
            continue
        tensors[name] = value.to(torch.bfloat16) if value.is_floating_point() else value
    return tensors


def checkpoint_blobs(model: Eagle3Drafter, taps: list[int], metadata: dict, engine: str = "vllm") -> dict[str, bytes]:
    """`{file name: bytes}` of the checkpoint folder for `engine`."""
    check_vocab(model.d2t, model.t2d)
    config = serving_config(model.spec, taps, metadata, engine)
    return {WEIGHTS: tensorio.dumps(serving_tensors(model)), CONFIG: (json.dumps(config, indent=2) + "\n").encode()}


def config_layer_ids(config: dict) -> list[int]:
    """The aux ids the engine will read (top level first, as vLLM looks them up)."""
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is not None and nested is not None and list(ids) != list(nested):
        raise ValueError(f"eagle_aux_hidden_state_layer_ids {ids} != eagle_config's {nested}")
    return list(ids if ids is not None else nested or [])


def expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every key the engine loads, with its shape, from the config fields the engine reads."""
    H, Ht, inter = config["hidden_size"], config["target_hidden_size"], config["intermediate_size"]
    h, g, d = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    n = len(config_layer_ids(config))
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (H, n * Ht),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.hidden_norm.weight": (H,),
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.mlp.gate_proj.weight": (inter, H),
        "midlayer.mlp.up_proj.weight": (inter, H),
        "midlayer.mlp.down_proj.weight": (H, inter),
        "norm.weight": (H,),
        "lm_head.weight": (config["draft_vocab_size"], H),
    }
    if config["draft_vocab_size"] != config["vocab_size"]:
        shapes |= {"d2t": (config["draft_vocab_size"],), "t2d": (config["vocab_size"],)}
    if config.get("fc_norm"):
        shapes |= {f"fc_norm.{i}.weight": (Ht,) for i in range(n)}
    spec = (config.get("draftsmith") or {}).get("spec") or {}
    if spec.get("attention", "gqa") == "gqa":
        shapes |= {
            "midlayer.self_attn.q_proj.weight": (h * d, 2 * H),
            "midlayer.self_attn.k_proj.weight": (g * d, 2 * H),
            "midlayer.self_attn.v_proj.weight": (g * d, 2 * H),
            "midlayer.self_attn.o_proj.weight": (H, h * d),
        }
    else:
        # Other attention variants (MLA) take their projection shapes from the drafter the spec builds.
        with torch.device("meta"):
            model = Eagle3Drafter(Eagle3Spec(**spec))
        shapes |= {k: tuple(v.shape) for k, v in model.state_dict().items() if k.startswith("midlayer.self_attn.")}
    return shapes


SGLANG_ALGORITHM = "EAGLE3"
TAP_IDS_ENGINES: tuple[str, ...] = ("vllm", "tokenspeed")  # their EAGLE-3 aux ids are our taps; SGLang's are tap - 1


def draft_tokens(*, depth: int | None = None, block_size: int | None = None) -> int:
    """A chain drafts its trained depth per round."""
    if not depth or depth < 1:
        raise ValueError("eagle3: the trained depth (drafter.ttt_depth) is needed for num_speculative_tokens")
    return depth


def num_speculative_tokens(config: dict, depth: int | None) -> int:
    return draft_tokens(depth=depth)


def speculative_args(engine: str, num_tokens: int) -> list[str]:
    return [
        "--speculative-num-steps", str(num_tokens), "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", str(num_tokens + 1),
    ]  # fmt: skip


def notes(engine: str) -> list[str]:
    return []


def recognizes(config: dict) -> bool:
    """EAGLE-3 folders are known by their architecture (they carry no method field)."""
    return any("Eagle3" in a for a in config.get("architectures", []))


def extra_files(blobs: dict[str, bytes], run_dir: str, model: Eagle3Drafter) -> dict[str, bytes]:
    return blobs


def load_drafter(
    folder: str, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor | None = None
) -> tuple[Eagle3Drafter, list[int]]:
    """Rebuild the fp32 drafter and its taps from a checkpoint folder (any engine's), sharing the target's embedding."""
    config = storage.read_json(storage.join(folder, CONFIG))
    spec = Eagle3Spec(**config["draftsmith"]["spec"])
    model = Eagle3Drafter(spec)
    tensors, _ = tensorio.loads(storage.read_bytes(storage.join(folder, WEIGHTS)))
    tensors["embed_tokens.weight"] = embed_weight
    if not pruned(spec) and "d2t" not in tensors:
        tensors["d2t"] = torch.zeros(spec.draft_vocab_size, dtype=torch.int64)
        tensors["t2d"] = torch.ones(spec.vocab_size, dtype=torch.bool)
    missing, unexpected = model.load_state_dict(
        {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}, strict=False
    )
    if missing or unexpected:
        raise ValueError(f"{folder}: checkpoint keys do not match: missing {missing}, unexpected {unexpected}")
    check_vocab(model.d2t, model.t2d)
    model.eval()
    return model, list(config["draftsmith"].get("taps") or config["eagle_aux_hidden_state_layer_ids"])
