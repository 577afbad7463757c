"""A small random Llama target for decoding tests: a tiny vocabulary makes a random drafter's guesses match
sometimes, so both acceptance and rollback are exercised."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM


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
