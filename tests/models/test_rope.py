"""RoPE frequencies and rotation equal transformers' bit for bit."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from specflow.models import ModelConfig
from specflow.models.rope import RotaryEmbedding, apply_rotary, rope_inv_freq

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
}


@pytest.mark.parametrize("name", list(ROPES))
def test_inv_freq_and_tables_equal_transformers(name):
    hf_cfg = LlamaConfig(hidden_size=512, num_attention_heads=4, rope_parameters=dict(ROPES[name]))
    cfg = ModelConfig.from_hf(hf_cfg.to_dict())
    ours = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    if name == "default":
        theirs, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(hf_cfg)
    else:
        theirs, _ = ROPE_INIT_FUNCTIONS[name](hf_cfg)
    assert torch.equal(ours, theirs)

    positions = torch.tensor([0, 1, 5, 5, 6, 1000, 70000])  # tree nodes may share a position
    cos, sin = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)(positions, torch.float32)
    hf_cos, hf_sin = LlamaRotaryEmbedding(hf_cfg)(torch.zeros(1), positions[None])
    assert torch.equal(cos, hf_cos[0]) and torch.equal(sin, hf_sin[0])

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(len(positions), 4, 128, generator=g), torch.randn(len(positions), 2, 128, generator=g)
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin)
    assert torch.equal(apply_rotary(q, cos, sin), hf_q[0].transpose(0, 1))
    assert torch.equal(apply_rotary(k, cos, sin), hf_k[0].transpose(0, 1))


def test_frequencies_are_real_on_a_meta_built_model():
    """load_model builds on the meta device; the non-persistent frequencies must still be real."""
    with torch.device("meta"):
        rope = RotaryEmbedding(16, 10000.0)
    assert rope.inv_freq.device.type == "cpu"
    assert torch.equal(rope.inv_freq, rope_inv_freq(16, 10000.0))
