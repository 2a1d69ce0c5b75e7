"""A tiny random Llama shared by the engine and trainer tests (a real model, not a fake)."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 32


def tiny_llama(seed: int = 0, vocab: int = VOCAB) -> LlamaForCausalLM:
    """2 layers, hidden 64, GQA 4/2 heads, tied embeddings, fp32, eval mode."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).float().eval()
