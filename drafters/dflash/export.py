"""DFlash / DFlash2 checkpoints in the format vLLM loads (`qwen3_dflash.py`, `qwen3_dflash2.py`), and back.

Architecture: `DFlash2DraftModel` when the dynamic conv and the candidate selector are both on (vLLM builds
both from `dflash_config`), `DFlashDraftModel` when both are off; one without the other has no vLLM class.
The draft is Qwen3-shaped (`model_type: qwen3`, per-head q_norm/k_norm). `dflash_config.target_layer_ids` =
taps - 1 for every engine (vLLM adds 1 back). The frozen embedding is never saved, and neither is the
frozen shared lm_head: vLLM shares both with the target when they are absent. With a pruned vocabulary the
trained `lm_head` and the d2t (int64) / t2d (bool) buffers are saved, as for EAGLE-3.
SGLang and TokenSpeed read the same z-lab `dflash_config` layout (SGLang docs, "DFlash Decoding"); their
handling of DFlash2 fields is not documented in the sources checked.
"""

import json

import torch

from draftsmith.core import storage, tensorio
from draftsmith.drafters.dflash.model import DFlashDrafter
from draftsmith.drafters.dflash.spec import DFlashSpec
from draftsmith.drafters.export import engines
from draftsmith.drafters.vocab import check_vocab

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
METHOD = "dflash"
DEFAULT_MAX_POSITIONS = 32768


def is_dflash2(spec: DFlashSpec) -> bool:
    return bool(spec.conv_kernel_size or spec.selector_rank)


def check_servable(spec: DFlashSpec, engine: str) -> None:
    """Refuse what `engine` cannot build (run by `draftsmith export`, not by the train stage's checkpoint).

    vLLM's DFlash2DraftModel builds both the conv and the candidate selector, DFlashDraftModel neither; its
    Qwen3 DFlash layers have no per-tap fc norms and no MLA attention.
    """
    if bool(spec.conv_kernel_size) != bool(spec.selector_rank):
        raise ValueError(
            f"dflash: conv_kernel_size={spec.conv_kernel_size} with selector_rank={spec.selector_rank}: vLLM's "
            "DFlash2DraftModel builds both the conv and the candidate selector, DFlashDraftModel neither"
        )
    if engine == "vllm" and (spec.fc_norm or spec.attention != "gqa"):
        raise ValueError(
            f"dflash: vLLM's qwen3_dflash has no fc_norm / MLA attention (fc_norm={spec.fc_norm}, "
            f"attention={spec.attention!r}); export this drafter for an engine with a matching loader"
        )


def backbone_config(spec: DFlashSpec, metadata: dict) -> dict:
    """The Qwen3 fields of the draft backbone that DFlash and DSpark share."""
    config = {
        "model_type": "qwen3",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "num_hidden_layers": spec.num_layers,
        "vocab_size": spec.vocab_size,
        "target_hidden_size": spec.target_hidden_size,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "max_position_embeddings": int(metadata.get("max_position_embeddings") or DEFAULT_MAX_POSITIONS),
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "block_size": spec.block_size,
    }
    if spec.rope_scaling:
        config["rope_scaling"] = spec.rope_scaling
    if spec.layer_types:
        config["layer_types"] = list(spec.layer_types)
        config["sliding_window"] = spec.sliding_window
    if spec.draft_vocab_size is not None:
        config["draft_vocab_size"] = spec.draft_vocab_size
    return config


def serving_config(spec: DFlashSpec, taps: list[int], metadata: dict, engine: str = "vllm") -> dict:
    """config.json for `dflash` on `engine`; our taps stay in `draftsmith.taps`."""
    dflash2 = is_dflash2(spec)
    layer_ids = engines.aux_layer_ids(METHOD, engine, taps)
    dflash_config = {"mask_token_id": spec.mask_token_id, "target_layer_ids": layer_ids, "block_size": spec.block_size}
    if dflash2:
        dflash_config |= {
            "conv_kernel_size": spec.conv_kernel_size,
            "conv_group_size": spec.conv_group_size,
            "selector_rank": spec.selector_rank,
            "selector_top_k": spec.selector_top_k,
        }
    return {
        "architectures": ["DFlash2DraftModel" if dflash2 else "DFlashDraftModel"],
        **backbone_config(spec, metadata),
        "num_target_layers": metadata.get("num_target_layers"),
        "dflash_config": dflash_config,
        "draftsmith": {"method": METHOD, "spec": spec.to_dict(), "taps": list(taps), "engine": engine, **metadata},
    }


def serving_tensors(model: DFlashDrafter) -> dict[str, torch.Tensor]:
    """The state dict without the shared (frozen) embedding and lm_head, floats in bf16."""
    shared = {"embed_tokens.weight"} | ({"lm_head.weight"} if model.spec.draft_vocab_size is None else set())
    return {
        name: value.to(torch.bfloat16) if value.is_floating_point() else value
        for name, value in model.state_dict().items()
        if name not in shared
    }


def checkpoint_blobs(model: DFlashDrafter, taps: list[int], metadata: dict, engine: str = "vllm") -> dict[str, bytes]:
    """`{file name: bytes}` of the checkpoint folder for `engine`."""
    if model.spec.draft_vocab_size is not None:
        check_vocab(model.d2t, model.t2d)
    config = serving_config(model.spec, taps, metadata, engine)
    return {WEIGHTS: tensorio.dumps(serving_tensors(model)), CONFIG: (json.dumps(config, indent=2) + "\n").encode()}


def config_layer_ids(config: dict) -> list[int]:
    return list(config["dflash_config"]["target_layer_ids"])


def backbone_shapes(config: dict, spec: DFlashSpec) -> dict[str, tuple[int, ...]]:
    """Keys and shapes of the Qwen3 backbone from the config fields the engine reads."""
    H, Ht, inter = config["hidden_size"], config["target_hidden_size"], config["intermediate_size"]
    h, g, d = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    n = spec.num_taps
    shapes: dict[str, tuple[int, ...]] = {"fc.weight": (H, n * Ht), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    if spec.fc_norm:
        shapes |= {f"fc_norm.{i}.weight": (Ht,) for i in range(n)}
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (H,),
            p + "post_attention_layernorm.weight": (H,),
            p + "mlp.gate_proj.weight": (inter, H),
            p + "mlp.up_proj.weight": (inter, H),
            p + "mlp.down_proj.weight": (H, inter),
        }
        if spec.attention == "gqa":
            shapes |= {
                p + "self_attn.q_proj.weight": (h * d, H),
                p + "self_attn.k_proj.weight": (g * d, H),
                p + "self_attn.v_proj.weight": (g * d, H),
                p + "self_attn.o_proj.weight": (H, h * d),
                p + "self_attn.q_norm.weight": (d,),
                p + "self_attn.k_norm.weight": (d,),
            }
    if spec.attention != "gqa":
        # MLA projection shapes come from the drafter the spec builds (no engine config names them).
        with torch.device("meta"):
            model = DFlashDrafter(spec)
        shapes |= {k: tuple(v.shape) for k, v in model.state_dict().items() if ".self_attn." in k}
    draft_vocab = config.get("draft_vocab_size")
    if draft_vocab is not None:
        shapes |= {"lm_head.weight": (draft_vocab, H), "d2t": (draft_vocab,), "t2d": (config["vocab_size"],)}
    return shapes


def expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    spec = DFlashSpec(**config["draftsmith"]["spec"])
    shapes = backbone_shapes(config, spec)
    dc = config["dflash_config"]
    if "conv_kernel_size" in dc:
        H, K = config["hidden_size"], dc["conv_kernel_size"]
        groups = H // dc["conv_group_size"]
        for i in range(config["num_hidden_layers"]):
            for conv in ("attention_conv", "mlp_conv"):
                shapes[f"layers.{i}.{conv}.base_kernel"] = (2, K, H)
                shapes[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * K * groups, H)
        V, r = config["vocab_size"], dc["selector_rank"]
        shapes |= {
            "candidate_selector.predecessor_codebook": (V, r),
            "candidate_selector.successor_codebook": (V, r),
            "candidate_selector.hidden_projection.weight": (r, H),
        }
    return shapes


SGLANG_ALGORITHM = "DFLASH"
TAP_IDS_ENGINES: tuple[str, ...] = ()  # every engine lists 0-based layer outputs: tap - 1


def draft_tokens(*, depth: int | None = None, block_size: int | None = None) -> int:
    """Block - 1: slot 0 is the anchor, which holds the verified token."""
    return engines.block_tokens(METHOD, block_size, anchor_predicts=False)


def num_speculative_tokens(config: dict, depth: int | None = None) -> int:
    return draft_tokens(block_size=config["block_size"])


def speculative_args(engine: str, num_tokens: int) -> list[str]:
    # A block drafter verifies the whole block: the anchor plus its drafts.
    return ["--speculative-num-draft-tokens", str(num_tokens + 1)]


def notes(engine: str) -> list[str]:
    out = []
    if engine == "tokenspeed":
        out.append("TokenSpeed's --speculative-config JSON schema is undocumented here; flags are printed instead.")
    if engine == "sglang":
        out.append("SGLang reads the block size from the draft config; verify the flags against your SGLang build.")
    return out


def recognizes(config: dict, method: str = METHOD) -> bool:
    """Block drafters' exports record their method in the `draftsmith` block."""
    return (config.get("draftsmith") or {}).get("method") == method


def extra_files(blobs: dict[str, bytes], run_dir: str, model: DFlashDrafter) -> dict[str, bytes]:
    return blobs


def load_state(model: torch.nn.Module, folder: str, extra: dict[str, torch.Tensor]) -> None:
    """Load the folder's weights (as fp32) plus the shared `extra` tensors, strictly."""
    tensors, _ = tensorio.loads(storage.read_bytes(storage.join(folder, WEIGHTS)))
    tensors |= extra
    missing, unexpected = model.load_state_dict(
        {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}, strict=False
    )
    if missing or unexpected:
        raise ValueError(f"{folder}: checkpoint keys do not match: missing {missing}, unexpected {unexpected}")


def shared_tensors(spec: DFlashSpec, folder: str, embed: torch.Tensor, head: torch.Tensor | None) -> dict:
    """The target's embedding, and its lm_head when the drafter shares it (no pruned vocabulary)."""
    if spec.draft_vocab_size is not None:
        return {"embed_tokens.weight": embed}
    if head is None:
        raise ValueError(f"{folder}: the drafter shares the target's lm_head; pass lm_head_weight")
    return {"embed_tokens.weight": embed, "lm_head.weight": head}


def load_drafter(
    folder: str, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor | None = None
) -> tuple[DFlashDrafter, list[int]]:
    """Rebuild the fp32 drafter and its taps, sharing the target's embedding (and lm_head when not pruned)."""
    config = storage.read_json(storage.join(folder, CONFIG))
    spec = DFlashSpec(**config["draftsmith"]["spec"])
    model = DFlashDrafter(spec)
    load_state(model, folder, shared_tensors(spec, folder, embed_weight, lm_head_weight))
    if spec.draft_vocab_size is not None:
        check_vocab(model.d2t, model.t2d)
    model.eval()
    return model, list(config["draftsmith"]["taps"])
