"""Tiny random transformers models, one per architecture variant the native models support.

(A uniquely named module rather than conftest.py, so that test files can import from it.)
"""

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)

# name -> transformers config; each exercises one feature of the native implementation
VARIANTS = {
    "llama": lambda: LlamaConfig(**SIZES),
    "llama3_rope": lambda: LlamaConfig(**SIZES, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "linear_rope": lambda: LlamaConfig(**SIZES, rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    "tied": lambda: LlamaConfig(**SIZES, tie_word_embeddings=True),
    "llama_bias": lambda: LlamaConfig(**SIZES, attention_bias=True, mlp_bias=True),
    "mistral": lambda: MistralConfig(**SIZES, sliding_window=4),
    "qwen2": lambda: Qwen2Config(**SIZES),
    "qwen3": lambda: Qwen3Config(**SIZES, head_dim=32),
}

PROMPTS = [[5, 17, 99, 3, 42, 8, 1, 77, 23, 64, 12], [9, 31, 7, 120, 56]]


def build_hf_model(variant: str, seed: int = 0):
    """A transformers model with every parameter (norm weights and biases too) randomised, so
    that biases, q/k norms and tied heads actually change the outputs."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(VARIANTS[variant]())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.generation_config.eos_token_id = None  # generate a fixed number of tokens
    return model.eval()


