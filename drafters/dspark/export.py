"""DSpark checkpoints in the format vLLM loads (`Qwen3DSparkModel`, `qwen3_dspark.py`), and back.

The backbone is DFlash's (`draftsmith.drafters.dflash.export`: Qwen3 fields, shared embedding, and lm_head shared
unless the vocabulary is pruned) plus `markov_head.markov_w1/w2` and, when enabled, `confidence_head.proj`.
vLLM reads top-level `block_size`, `target_layer_ids` (= taps - 1; it adds 1 back), `mask_token_id`,
`markov_rank`, `markov_head_type` ("vanilla", the low-rank bigram head), `enable_confidence_head`,
`confidence_head_with_markov`, `sample_from_anchor` (true: the anchor slot predicts, our `predict_anchor`)
and `draft_vocab_size`. SGLang reads the same fields nested in `dflash_config` with `projector_type: "dspark"`
(algorithms.md §2, SpecForge layout); that block is written for SGLang only. TokenSpeed's DSpark layout is
not documented in the sources checked, so a TokenSpeed export carries the vLLM layout.
vLLM serves DSpark on the V2 model runner only.
"""

import json

import torch

from draftsmith.core import storage, tensorio
from draftsmith.drafters.dflash import export as dflash_export
from draftsmith.drafters.dspark.model import DSparkDrafter, DSparkSpec
from draftsmith.drafters.export import engines
from draftsmith.drafters.vocab import check_vocab

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
METHOD = "dspark"


def check_servable(spec: DSparkSpec, engine: str) -> None:
    dflash_export.check_servable(spec, engine)


def serving_config(spec: DSparkSpec, taps: list[int], metadata: dict, engine: str = "vllm") -> dict:
    """config.json for `dspark` on `engine`; our taps stay in `draftsmith.taps`."""
    layer_ids = engines.aux_layer_ids(METHOD, engine, taps)
    fields = {
        "block_size": spec.block_size,
        "target_layer_ids": layer_ids,
        "mask_token_id": spec.mask_token_id,
        "num_target_layers": metadata.get("num_target_layers"),
        "markov_rank": spec.markov_rank,
        "markov_head_type": "vanilla",
        "enable_confidence_head": spec.enable_confidence_head,
        "confidence_head_with_markov": spec.confidence_head_with_markov,
        "sample_from_anchor": True,
    }
    config = {"architectures": ["Qwen3DSparkModel"], **dflash_export.backbone_config(spec, metadata), **fields}
    if engine == "sglang":
        config["dflash_config"] = {"projector_type": "dspark", **fields}
    config["draftsmith"] = {"method": METHOD, "spec": spec.to_dict(), "taps": list(taps), "engine": engine, **metadata}
    return config


def checkpoint_blobs(model: DSparkDrafter, taps: list[int], metadata: dict, engine: str = "vllm") -> dict[str, bytes]:
    """`{file name: bytes}` of the checkpoint folder for `engine`."""
    if model.spec.draft_vocab_size is not None:
        check_vocab(model.d2t, model.t2d)
    config = serving_config(model.spec, taps, metadata, engine)
    tensors = dflash_export.serving_tensors(model)
    return {WEIGHTS: tensorio.dumps(tensors), CONFIG: (json.dumps(config, indent=2) + "\n").encode()}


def config_layer_ids(config: dict) -> list[int]:
    """The ids the engine reads: `dflash_config`'s when present (it takes precedence in vLLM and SGLang)."""
    ids = list(config["target_layer_ids"])
    nested = (config.get("dflash_config") or {}).get("target_layer_ids")
    if nested is not None and list(nested) != ids:
        raise ValueError(f"target_layer_ids {ids} != dflash_config.target_layer_ids {list(nested)}")
    return ids


def expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    spec = DSparkSpec(**config["draftsmith"]["spec"])
    shapes = dflash_export.backbone_shapes(config, spec)
    H, V, r = config["hidden_size"], config["vocab_size"], config["markov_rank"]
    out_vocab = config.get("draft_vocab_size") or V
    shapes |= {"markov_head.markov_w1.weight": (V, r), "markov_head.markov_w2.weight": (out_vocab, r)}
    if config["enable_confidence_head"]:
        width = H + (r if config["confidence_head_with_markov"] else 0)
        shapes |= {"confidence_head.proj.weight": (1, width), "confidence_head.proj.bias": (1,)}
    return shapes


SGLANG_ALGORITHM = "DSPARK"
TAP_IDS_ENGINES: tuple[str, ...] = ()  # every engine lists 0-based layer outputs: tap - 1


def draft_tokens(*, depth: int | None = None, block_size: int | None = None) -> int:
    """The whole block: DSpark's anchor slot predicts too."""
    return engines.block_tokens(METHOD, block_size, anchor_predicts=True)


def num_speculative_tokens(config: dict, depth: int | None = None) -> int:
    return draft_tokens(block_size=config["block_size"])


def speculative_args(engine: str, num_tokens: int) -> list[str]:
    if engine == "sglang":
        return ["--speculative-dspark-block-size", str(num_tokens)]
    return ["--speculative-num-draft-tokens", str(num_tokens + 1)]  # the anchor plus its drafts


def notes(engine: str) -> list[str]:
    out = []
    if engine == "vllm":
        out.append("vLLM serves DSpark on the V2 model runner only (GPU; V1 refuses method 'dspark').")
    if engine == "tokenspeed":
        out.append(
            "TokenSpeed's DSpark flags are not documented in the sources checked; "
            "the command reuses its EAGLE3/DFLASH flags with algorithm DSPARK, unverified."
        )
    return out + dflash_export.notes(engine)  # and what holds for every block drafter


def recognizes(config: dict) -> bool:
    return dflash_export.recognizes(config, METHOD)


def extra_files(blobs: dict[str, bytes], run_dir: str, model: DSparkDrafter) -> dict[str, bytes]:
    """The evaluate stage's confidence calibration, when there is one, travels with the export:
    `calibration.json` plus `confidence_temperatures` in config.json (the field DSpark checkpoints carry)."""
    from draftsmith.drafters import confidence as cal
    from draftsmith.drafters.export import guards

    url = storage.join(run_dir, "evaluate", cal.CALIBRATION_FILE)
    if not storage.exists(url):
        return blobs
    fitted = cal.Calibration.from_json(storage.read_bytes(url))
    if len(fitted.temperatures) != model.spec.block_size:
        raise guards.ExportError(
            f"{url}: {len(fitted.temperatures)} temperatures for a block of {model.spec.block_size}"
        )
    config = json.loads(blobs[CONFIG]) | cal.calibration_config(fitted)
    config.setdefault("draftsmith", {})["calibration"] = fitted.to_dict()
    return blobs | {
        CONFIG: (json.dumps(config, indent=2) + "\n").encode(),
        cal.CALIBRATION_FILE: fitted.to_json().encode(),
    }


def load_drafter(
    folder: str, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor | None = None
) -> tuple[DSparkDrafter, list[int]]:
    """Rebuild the fp32 drafter and its taps, sharing the target's embedding (and lm_head when not pruned)."""
    config = storage.read_json(storage.join(folder, CONFIG))
    spec = DSparkSpec(**config["draftsmith"]["spec"])
    model = DSparkDrafter(spec)
    dflash_export.load_state(model, folder, dflash_export.shared_tensors(spec, folder, embed_weight, lm_head_weight))
    if spec.draft_vocab_size is not None:
        check_vocab(model.d2t, model.t2d)
    model.eval()
    return model, list(config["draftsmith"]["taps"])
