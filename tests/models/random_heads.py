"""Random draft heads written in the public layouts *by hand* (literal key names, plain
torch.save / safetensors), so that loading them tests the layout, not our own writer."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from specflow.models import ModelConfig


def head_hf(target: ModelConfig, **extra) -> dict:
    """A one-layer Llama config.json for a head on ``target`` (4 heads, 2 KV heads, as EAGLE ships)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": target.vocab_size,
            "hidden_size": target.hidden_size, "intermediate_size": 2 * target.hidden_size,
            "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
            "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "max_position_embeddings": 2048, **extra}


def _layer(prefix: str, h: int, inter: int, q_in: int, g: torch.Generator, input_norm: bool) -> dict:
    hd = h // 4  # head_dim with 4 heads

    def w(*shape):  # unit gain: rows of norm ~1
        return torch.randn(*shape, generator=g) / shape[-1] ** 0.5

    state = {
        f"{prefix}self_attn.q_proj.weight": w(4 * hd, q_in), f"{prefix}self_attn.k_proj.weight": w(2 * hd, q_in),
        f"{prefix}self_attn.v_proj.weight": w(2 * hd, q_in), f"{prefix}self_attn.o_proj.weight": w(h, 4 * hd),
        f"{prefix}mlp.gate_proj.weight": w(inter, h), f"{prefix}mlp.up_proj.weight": w(inter, h),
        f"{prefix}mlp.down_proj.weight": w(h, inter),
        f"{prefix}post_attention_layernorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
    }
    if input_norm:
        state[f"{prefix}input_layernorm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    return state


def eagle_state(hf: dict, seed: int = 0, bias: bool = True) -> dict[str, torch.Tensor]:
    """SafeAILab/EAGLE cnets1.py keys: fc [H, 2H] (+ bias), layers.{i} (no input_layernorm at 0)."""
    g = torch.Generator().manual_seed(seed)
    h, inter = hf["hidden_size"], hf["intermediate_size"]
    state = {"fc.weight": torch.randn(h, 2 * h, generator=g) / (2 * h) ** 0.5 * 2}
    if bias:
        state["fc.bias"] = 0.1 * torch.randn(h, generator=g)
    for i in range(hf["num_hidden_layers"]):
        state |= _layer(f"layers.{i}.", h, inter, h, g, input_norm=i > 0)
    return state


def eagle3_state(hf: dict, num_taps: int = 3, seed: int = 0,
                 hot: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """SafeAILab/EAGLE cnets.py keys: fc [H, 3H], midlayer.* (q/k/v over 2H), norm, lm_head
    [draft_vocab, H], d2t offsets and t2d; ``hot`` = the target ids of the draft vocabulary."""
    g = torch.Generator().manual_seed(seed)
    h, inter, vocab = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"]
    hot = torch.arange(vocab) if hot is None else hot
    state = {"fc.weight": torch.randn(h, num_taps * h, generator=g) / (num_taps * h) ** 0.5 * 2}
    state |= _layer("midlayer.", h, inter, 2 * h, g, input_norm=True)
    state["midlayer.hidden_norm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    state["norm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    state["lm_head.weight"] = torch.randn(len(hot), h, generator=g) * 0.5
    state["d2t"] = hot - torch.arange(len(hot))
    state["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, hot, True)
    return state


def medusa_state(hidden: int, vocab: int, num_heads: int, num_layers: int = 1,
                 seed: int = 0) -> dict[str, torch.Tensor]:
    """FasterDecoding/Medusa keys: {i}.{j}.linear.{weight,bias}, {i}.{num_layers}.weight [V, H]."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for i in range(num_heads):
        for j in range(num_layers):
            state[f"{i}.{j}.linear.weight"] = torch.randn(hidden, hidden, generator=g) / hidden ** 0.5
            state[f"{i}.{j}.linear.bias"] = 0.1 * torch.randn(hidden, generator=g)
        state[f"{i}.{num_layers}.weight"] = torch.randn(vocab, hidden, generator=g) * 0.5
    return state


def write_checkpoint(path: Path, hf: dict, state: dict[str, torch.Tensor], fmt: str,
                     names: tuple[str, str] = ("model.safetensors", "pytorch_model.bin")) -> Path:
    """config.json + the weights as safetensors ("safetensors") or a torch pickle ("bin")."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf))
    if fmt == "safetensors":
        save_file(state, path / names[0])
    else:
        torch.save(state, path / names[1])
    return path
