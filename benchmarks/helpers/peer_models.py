"""speculators (the vLLM project's drafter library) models built from this project's exports: the peer side of
`tests/integration/test_speculators_interop.py`. Runs under `.venv-speculators/bin/python` only.

How each export reaches the peer (speculators 0.9.0):
- EAGLE-3: the peer's own converter for EAGLE-format checkpoints (`convert_model(algorithm="eagle3")`), then
  `Eagle3DraftModel.from_pretrained`. The converter drops `fc_norm.{i}.weight` (its intermediate model has no
  fc_norm), so those come back as 1.0; `load_exported` reports such keys and puts ours back by name.
- DFlash: the peer's automatic conversion of z-lab DFlash checkpoints (`maybe_convert_external_checkpoint`).
- DFlash2 and DSpark: the peer has no loader for the vLLM layout (its converter knows plain DFlash only and
  refuses the conv/selector keys; a DSpark folder is "unrecognized external format"). Its model classes take
  our weight names unchanged, so the config is derived from our config.json here and the safetensors are
  loaded strictly by name.
"""

import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

# Flex attention on CPU needs torch.compile; SDPA is the peer's dense-mask path, the same maths.
ATTN = "sdpa"
# Weights the peer fills from the verifier (target) folder rather than the drafter checkpoint.
VERIFIER_OWNED = {"embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight", "lm_head.weight"}


def _qwen3_layer_config(cfg: dict) -> dict:
    keys: tuple[str, ...] = (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
    )
    keys += ("num_hidden_layers", "vocab_size", "rms_norm_eps", "rope_theta", "max_position_embeddings")
    out = {k: cfg[k] for k in keys if k in cfg}
    return out | {"model_type": "qwen3", "hidden_act": "silu", "attention_bias": False, "_attn_implementation": ATTN}


def block_config(family: str, cfg: dict, verifier: str):
    """The peer's DFlash2 / DSpark config for our vLLM-layout config.json (`target_layer_ids` are 0-based layer
    outputs; the peer's aux ids count the embedding as 0, like our taps)."""
    from speculators import SpeculatorsConfig, VerifierConfig
    from speculators.models import DFlash2SpeculatorConfig, DSparkSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    if family == "dflash2":
        dc = cfg["dflash_config"]
        ids, cls, extra = dc["target_layer_ids"], DFlash2SpeculatorConfig, {"sample_from_anchor": False}
        extra |= {k: dc[k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")}
        tokens = cfg["block_size"] - 1
    else:
        ids, cls, tokens = cfg["target_layer_ids"], DSparkSpeculatorConfig, cfg["block_size"]
        keys = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")
        extra = {k: cfg[k] for k in (*keys, "sample_from_anchor")}
    verifier_arch = json.loads((Path(verifier) / "config.json").read_text()).get("architectures", [])
    return cls(
        transformer_layer_config=_qwen3_layer_config(cfg),
        draft_vocab_size=cfg.get("draft_vocab_size") or cfg["vocab_size"],
        block_size=cfg["block_size"],
        aux_hidden_state_layer_ids=[i + 1 for i in ids],
        mask_token_id=cfg.get("mask_token_id", (cfg.get("dflash_config") or {}).get("mask_token_id")),
        speculators_config=SpeculatorsConfig(
            algorithm=family,
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=tokens)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=verifier, architectures=verifier_arch),
        ),
        **extra,
    )


def _from_converted(family: str, folder: str, verifier: str, work: str):
    from speculators.convert.entrypoints import convert_model, maybe_convert_external_checkpoint
    from speculators.models import DFlashDraftModel, DFlashSpeculatorConfig, Eagle3DraftModel, Eagle3SpeculatorConfig

    out = str(Path(work) / f"{family}-converted")
    if family == "eagle3":
        ids = json.loads((Path(folder) / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"]
        convert_model(folder, verifier, "eagle3", output_path=out, eagle_aux_hidden_state_layer_ids=ids)
        model_cls, config_cls = Eagle3DraftModel, Eagle3SpeculatorConfig
    else:
        maybe_convert_external_checkpoint(folder, verifier=verifier, output_path=out)
        model_cls, config_cls = DFlashDraftModel, DFlashSpeculatorConfig
    config = config_cls.from_pretrained(out)
    config.transformer_layer_config._attn_implementation = ATTN
    # fp32 from the start: loaded in the checkpoint's bf16, the RoPE frequencies would stay bf16-rounded.
    model = model_cls.from_pretrained(out, config=config, dtype=torch.float32)
    # `from_pretrained` leaves an EAGLE-3 embedding that is not in the checkpoint at zeros, and the public
    # `load_verifier_weights` only fills NaN ones; the peer's DFlash loader overwrites it from the verifier.
    model._load_verifier_weights(overwrite_embed_tokens=True)
    return model


def _from_classes(family: str, folder: str, verifier: str):
    from speculators.models import DFlash2DraftModel, DSparkDraftModel

    cfg = json.loads((Path(folder) / "config.json").read_text())
    config = block_config(family, cfg, verifier)
    model = (DFlash2DraftModel if family == "dflash2" else DSparkDraftModel)(config)
    model.load_verifier_weights()
    tensors = load_file(str(Path(folder) / "model.safetensors"))
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
    if unexpected or set(missing) - VERIFIER_OWNED:
        raise ValueError(f"{folder}: {family} keys do not match: missing {missing}, unexpected {unexpected}")
    return model


def load_exported(family: str, folder: str, verifier: str) -> tuple[torch.nn.Module, dict]:
    """The peer's fp32 model for our export `folder`, and a report on how our tensors landed in it:
    `dropped` (ours, but the peer's value differs after loading: put back by name), `unexpected` (ours, no peer
    parameter of that name) and `unfilled` (peer tensors neither in our export nor verifier-owned)."""
    with tempfile.TemporaryDirectory() as work:
        if family in ("eagle3", "dflash"):
            model = _from_converted(family, folder, verifier, work)
        else:
            model = _from_classes(family, folder, verifier)
    model = model.float().eval()
    ours = load_file(str(Path(folder) / "model.safetensors"))
    if family == "eagle3":
        ours = {k.replace("midlayer.", "layers.0.", 1): v for k, v in ours.items()}
    state = model.state_dict()
    unexpected = sorted(k for k in ours if k not in state)
    dropped = sorted(k for k, v in ours.items() if k in state and not torch.equal(state[k].to(v.dtype).cpu(), v.cpu()))
    unfilled = sorted(k for k in state if k not in ours and k not in VERIFIER_OWNED)
    if dropped:
        fix = {k: ours[k].float() if ours[k].is_floating_point() else ours[k] for k in dropped}
        model.load_state_dict(fix, strict=False)
    nan = sorted(k for k, v in model.state_dict().items() if v.is_floating_point() and v.isnan().any())
    return model, {"dropped": dropped, "unexpected": unexpected, "unfilled": unfilled, "nan": nan}
