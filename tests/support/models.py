"""Tiny models for tests: a small random Llama target, and drafters of every family at toy shapes.

A tiny vocabulary makes a random drafter's guesses match the target sometimes, so decoding tests exercise
both acceptance and rollback. Each family's builders keep the shapes their tests were written for; the
constants are prefixed by family (`DSPARK_V`), and a test imports them under its short names.
"""

from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from draftsmith.drafters.dflash import DFlashDrafter, DFlashSpec
from draftsmith.drafters.dspark.model import DSparkDrafter, DSparkSpec
from draftsmith.drafters.eagle3.decode import DraftCache, draft_forward
from draftsmith.drafters.eagle3.model import Eagle3Drafter, Eagle3Spec
from draftsmith.drafters.export import bundle
from draftsmith.drafters.vocab import build_draft_vocab

# Tiny targets.


def small_llama(vocab: int = 12, hidden: int = 24, *, seed: int = 0, std: float = 0.5) -> LlamaForCausalLM:
    """4 layers, 4 heads (2 kv), untied head, weights drawn N(0, std) so greedy text is not degenerate."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, std)
    return model


def check_chain_matches_ttt(
    model: Eagle3Drafter, ids_1S: torch.Tensor, feats_1SF: torch.Tensor, depth: int, positions: range
) -> list[DraftCache]:
    """Assert equality (1e-5) at every depth for each start `t` in `positions`; returns each chain's cache."""
    ttt = model.ttt_forward(ids_1S, feats_1SF, depth)
    caches = []
    for t in positions:
        cache = DraftCache()
        logits, hidden = draft_forward(model, ids_1S[0, 1 : t + 2], model.fuse(feats_1SF[:, : t + 1])[0], 0, cache)
        torch.testing.assert_close(logits[-1], ttt[0][0, t], rtol=1e-5, atol=1e-5)
        hidden = hidden[-1:]
        for k in range(1, depth):
            logits, hidden = draft_forward(model, ids_1S[0, t + 1 + k].view(1), hidden, t + k, cache)
            torch.testing.assert_close(logits[-1], ttt[k][0, t], rtol=1e-5, atol=1e-5)
        caches.append(cache)
    return caches


# DSpark.

DSPARK_V, DSPARK_HT, DSPARK_TAPS, DSPARK_K = 40, 16, 2, 4


# A pruned vocabulary of 24 with non-trivial offsets: all 20 odd ids, then the smallest even ids 0, 2, 4, 6.
ODD_D2T, ODD_T2D = build_draft_vocab(torch.arange(DSPARK_V) % 2, 24)


def dspark_spec(**kw: Any) -> DSparkSpec:
    base: dict[str, Any] = dict(
        hidden_size=32, target_hidden_size=DSPARK_HT, num_taps=DSPARK_TAPS, num_layers=2, num_heads=4, num_kv_heads=2
    )
    base |= dict(
        head_dim=8,
        intermediate_size=48,
        vocab_size=DSPARK_V,
        block_size=DSPARK_K,
        mask_token_id=DSPARK_V - 1,
        markov_rank=8,
    )
    return DSparkSpec(**(base | kw))


def dspark_drafter(seed: int = 0, **kw) -> DSparkDrafter:
    torch.manual_seed(seed)
    model = DSparkDrafter(dspark_spec(**kw))
    # A trained Markov head is non-zero; a zero one would hide any slip in which token it conditions on.
    torch.nn.init.normal_(model.markov_head.markov_w2.weight, std=1.0)
    return model


def dspark_batch(seed: int = 1, B: int = 2, S: int = 14) -> dict:
    g = torch.Generator().manual_seed(seed)
    loss_mask = torch.ones(B, S, dtype=torch.bool)
    loss_mask[:, :3] = False  # a prompt
    loss_mask[1, 10] = False  # a hole that cuts blocks' supervised prefix
    return {
        "input_ids": torch.randint(0, DSPARK_V - 1, (B, S), generator=g),
        "loss_mask": loss_mask,
        "features": torch.randn(B, S, DSPARK_TAPS * DSPARK_HT, generator=g),
        "last_hidden": torch.randn(B, S, DSPARK_HT, generator=g),
    }


def random_dspark(vocab: int, ht: int, seed: int, **kw) -> DSparkDrafter:
    """A DSpark drafter over `TAPS3` of an `ht`-wide target, every weight N(0, 0.3) (the Markov head included)."""
    spec = dspark_spec(vocab_size=vocab, target_hidden_size=ht, num_taps=len(TAPS3), mask_token_id=vocab - 1, **kw)
    torch.manual_seed(seed)
    model = DSparkDrafter(spec)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model.eval()


TAPS3 = [1, 2, 3]


# EAGLE-3.


def eagle3_drafter(norm_output: bool, fc_norm: bool) -> Eagle3Drafter:
    torch.manual_seed(0)
    spec = Eagle3Spec(
        hidden_size=32,
        target_hidden_size=24,
        num_taps=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=64,
        vocab_size=50,
        draft_vocab_size=50,
        rope_theta=10000.0,
        fc_norm=fc_norm,
        norm_output=norm_output,
    )
    model = Eagle3Drafter(spec).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


# TTT batches.

TTT_B, TTT_S, TTT_DEPTH = 2, 12, 3


def ttt_batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (TTT_B, TTT_S), generator=g)
    feats = torch.randn(TTT_B, TTT_S, 3 * 24, generator=g)
    loss_mask = torch.rand(TTT_B, TTT_S, generator=g) > 0.3
    in_draft = torch.rand(TTT_B, TTT_S, generator=g) > 0.2
    last = torch.randn(TTT_B, TTT_S, 24, generator=g)
    head = torch.randn(50, 24, generator=g)
    return ids, feats, loss_mask, in_draft, last, head


# DFlash.

DFLASH_TAPS = [1, 2, 3]


def dflash_drafter(vocab: int, ht: int, seed: int, **kw) -> DFlashDrafter:
    spec = DFlashSpec(
        hidden_size=32,
        target_hidden_size=ht,
        num_taps=len(DFLASH_TAPS),
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=64,
        vocab_size=vocab,
        block_size=4,
        mask_token_id=vocab - 1,
        **kw,
    )
    torch.manual_seed(seed)
    model = DFlashDrafter(spec)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model.eval()


DFLASH_VARIANTS: dict[str, dict[str, Any]] = {
    "dflash": {},
    "dflash2": dict(
        conv_kernel_size=2,
        conv_group_size=8,
        selector_rank=4,
        selector_top_k=3,
        layer_types=("sliding_attention", "full_attention"),
        sliding_window=3,
    ),
    "dspark-like": dict(predict_anchor=True, draft_vocab_size=8),
}


# EAGLE-3 with MLA attention.

MLA_FIELDS = {"kv_lora_rank": 12, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 12}


MLA_H, MLA_HT, MLA_TAPS, MLA_V = 32, 24, 3, 50


def eagle3_mla_spec(**kw: Any) -> Eagle3Spec:
    base: dict[str, Any] = dict(
        hidden_size=MLA_H,
        target_hidden_size=MLA_HT,
        num_taps=MLA_TAPS,
        num_heads=4,
        num_kv_heads=4,
        head_dim=16,
        intermediate_size=64,
        vocab_size=MLA_V,
        draft_vocab_size=MLA_V,
        attention="mla",
        mla=MLA_FIELDS,
    )
    return Eagle3Spec(**(base | kw))


def eagle3_mla_drafter(spec: Eagle3Spec, seed: int = 0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    model = Eagle3Drafter(spec).eval()
    with torch.no_grad():
        for p in model.parameters():  # RMSNorm weights start at one; make them count
            p.normal_(0, 0.3)
    return model


# SmolLM2-sized random EAGLE-3 exports (the real target's shapes, for the vLLM tests).

SMOLLM2_TAPS = [2, 15, 27]


def random_smollm2_eagle3(embed: torch.Tensor):
    from draftsmith.drafters import vocab
    from draftsmith.drafters.eagle3.model import Eagle3Drafter, Eagle3Spec

    torch.manual_seed(0)
    spec = Eagle3Spec(
        hidden_size=576, target_hidden_size=576, num_taps=3, num_heads=9, num_kv_heads=3, head_dim=64,
        intermediate_size=1536, vocab_size=49152, draft_vocab_size=4096, rope_theta=100000.0,
    )  # fmt: skip
    model = Eagle3Drafter(spec).eval()
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embed)
    d2t, t2d = vocab.build_draft_vocab(torch.arange(49152).flip(0), 4096)
    model.d2t.copy_(d2t)
    model.t2d.copy_(t2d)
    return model


def export_random_smollm2_eagle3(embed: torch.Tensor, out: Path) -> None:
    model = random_smollm2_eagle3(embed)
    blobs = bundle.export_drafter(
        "eagle3", model, SMOLLM2_TAPS, {}, engine="vllm", num_target_layers=30, target_embed_VH=embed
    )
    bundle.write_folder(out, blobs)


# Drafter families at the tiny target.

BLOCK_FAMILY = {
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "mask_token_id": 16,
    "num_anchors": 8,
    "draft_vocab_size": 512,
    "fc_norm": False,
}


FAMILY_CASES = {
    "dflash2": (
        BLOCK_FAMILY
        | {"kind": "dflash2", "block_size": 4, "selector_rank": 8, "selector_top_k": 4, "draft_vocab_size": None},
        "DFlash2DraftModel",
        3,
    ),
    "dspark": (BLOCK_FAMILY | {"kind": "dspark", "block_size": 4, "markov_rank": 8}, "Qwen3DSparkModel", 4),
    "eagle3": (
        {
            "kind": "eagle3",
            "attention": "mla",
            "mla": {
                "kv_lora_rank": 16,
                "q_lora_rank": 24,
                "qk_nope_head_dim": 8,
                "qk_rope_head_dim": 8,
                "v_head_dim": 8,
            },
            "num_heads": 4,
            "num_kv_heads": 4,
            "head_dim": 16,
            "intermediate_size": 128,
            "draft_vocab_size": 512,
            "ttt_depth": 3,
            "fc_norm": True,
            "norm_output": True,
            "anchored": {"num_anchors": 8, "max_gap": 2},
        },
        "Eagle3DeepseekV3ForCausalLM",
        3,
    ),
}
