"""The peer's side of `benchmarks.peer_train`: speculators' own training forward and loss (`model(**batch,
**train_kwargs)`, the call its trainer makes), backward and AdamW, on the shared inputs.

`.venv-speculators/bin/python -m benchmarks.workers.peer_step JOB` prints one JSON line `{"step_s": [...],
"peak_rss": bytes}` (warm-up steps excluded). Models are built from configs as its `from_training_args` does,
with the verifier's embedding and head; attention is SDPA (flex attention on CPU needs torch.compile) and
losses use its eager implementation (the fused one is Triton on a GPU).
"""

import json
import resource
import sys
import time

import torch
from safetensors.torch import load_file

ATTN = "sdpa"


def _speculators_config(family: str, job: dict, tokens: int):
    from speculators import SpeculatorsConfig, VerifierConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    verifier = VerifierConfig(name_or_path=job["verifier"], architectures=["LlamaForCausalLM"])
    methods = [GreedyTokenProposalConfig(speculative_tokens=tokens)]
    return SpeculatorsConfig(
        algorithm=family, proposal_methods=methods, default_proposal_method="greedy", verifier=verifier
    )


def build(job: dict, x: dict) -> tuple[torch.nn.Module, dict]:
    """The peer's model for `job["peer"]` shapes and its training kwargs (`get_trainer_kwargs`)."""
    from speculators.models import (
        DFlashDraftModel,
        DFlashSpeculatorConfig,
        DSparkDraftModel,
        DSparkSpeculatorConfig,
        Eagle3DraftModel,
        Eagle3SpeculatorConfig,
    )
    from transformers import LlamaConfig, PretrainedConfig, Qwen3Config

    p = job["peer"]
    family = p["family"]
    layer = dict(
        vocab_size=p["vocab_size"], hidden_size=p["hidden_size"], intermediate_size=p["intermediate_size"],
        num_attention_heads=p["num_heads"], num_key_value_heads=p["num_kv_heads"], head_dim=p["head_dim"],
        num_hidden_layers=p["num_layers"], rms_norm_eps=1e-6, max_position_embeddings=4096,
    )  # fmt: skip
    losses = {"loss_fn": "kl_div", "loss_implementation": "eager"}
    layer_config: PretrainedConfig
    if family == "eagle3":
        layer_config = LlamaConfig(**layer)
        layer_config._attn_implementation = ATTN
        config = Eagle3SpeculatorConfig(
            transformer_layer_config=layer_config, draft_vocab_size=p["draft_vocab_size"],
            eagle_aux_hidden_state_layer_ids=job["taps"], norm_before_residual=False,
            speculators_config=_speculators_config(family, job, p["ttt_steps"]),
        )  # fmt: skip
        model = Eagle3DraftModel(config)
        model.load_vocab_mappings(x["t2d"].bool(), x["d2t"])
        kwargs = model.get_trainer_kwargs(**losses, ttt_steps=p["ttt_steps"], ttt_step_loss_decay=0.8)[0]
    else:
        layer_config = Qwen3Config(**layer)
        layer_config._attn_implementation = ATTN
        dspark = family == "dspark"
        config_cls, model_cls = (
            (DSparkSpeculatorConfig, DSparkDraftModel) if dspark else (DFlashSpeculatorConfig, DFlashDraftModel)
        )
        extra = {"markov_rank": p["markov_rank"], "enable_confidence_head": True} if dspark else {}
        config = config_cls(
            transformer_layer_config=layer_config, draft_vocab_size=p["vocab_size"], block_size=p["block_size"],
            aux_hidden_state_layer_ids=job["taps"], mask_token_id=p["mask_token_id"], sample_from_anchor=dspark,
            speculators_config=_speculators_config(family, job, p["block_size"] - (0 if dspark else 1)), **extra,
        )  # fmt: skip
        model = model_cls(config)
        kwargs = model.get_trainer_kwargs(**losses, max_anchors=p["num_anchors"])[0]
    model.load_verifier_weights()
    return model.float().train(), kwargs


def main(path: str) -> None:
    job = json.loads(open(path).read())
    torch.set_num_threads(job["threads"])
    torch.manual_seed(0)
    x = load_file(job["inputs"])
    model, kwargs = build(job, x)
    ids = x["input_ids"]
    batch = {
        "hidden_states": x["features"],
        "input_ids": ids,
        "loss_mask": x["loss_mask"].long(),
        "verifier_last_hidden_states": x["last_hidden"],
        "document_ids": torch.zeros_like(ids),
        "position_ids": torch.arange(ids.shape[1])[None],
    }
    opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-4)
    times = []
    for _ in range(job["warmup"] + job["steps"]):
        start = time.perf_counter()
        loss = model(**batch, **kwargs)[1]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"step_s": times[job["warmup"] :], "peak_rss": peak}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
