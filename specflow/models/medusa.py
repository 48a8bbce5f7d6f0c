"""Medusa heads in the public layout of FasterDecoding/Medusa (``medusa_model.py``).

config.json carries ``medusa_num_heads`` and ``medusa_num_layers`` (both inferred from the
tensors when absent). The weights (``medusa_lm_head.safetensors`` / ``medusa_lm_head.pt`` as
Medusa saves them, or ``model.safetensors`` / ``pytorch_model.bin``) are the state dict of the
``medusa_head`` ModuleList::

    {i}.{j}.linear.weight [H, H], {i}.{j}.linear.bias [H]   ResBlock j of head i: x + SiLU(linear(x))
    {i}.{L}.weight [V, H]                                     head i's vocabulary projection (no bias)

Alignment (``MedusaModel.forward``): every head reads the target's final normed hidden state
h_t of the last committed token t; the target's own lm_head on h_t gives token t + 1 (the next
root) and head i gives token t + 2 + i, i.e. the tree nodes at depth i + 1.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specflow.models.config import CheckpointError
from specflow.models.head_io import WEIGHT_FILES, Format, assign_state, check_fits, read_head, write_head
from specflow.models.llama import LlamaForCausalLM, checkpoint_state

MEDUSA_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")


class ResBlock(nn.Module):
    """x + SiLU(Linear(x)) (Medusa initialises the linear to zero: an identity at first)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.ModuleList):
    """``num_heads`` heads, each ``num_layers`` ResBlocks then Linear(H, V, bias=False); the
    module is the ``medusa_head`` ModuleList itself, so its state dict has the public keys."""

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int = 1):
        super().__init__(nn.Sequential(*[ResBlock(hidden_size) for _ in range(num_layers)],
                                       nn.Linear(hidden_size, vocab_size, bias=False))
                         for _ in range(num_heads))
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.num_heads, self.num_layers = num_heads, num_layers

    def forward(self, hidden: Tensor) -> Tensor:
        """[T, H] -> [num_heads, T, V] logits; head i predicts the token i + 2 after h's token."""
        return torch.stack([head(hidden) for head in self])


def _count(state: dict[str, Tensor], pattern: str) -> int:
    """1 + the largest integer captured by ``pattern`` over the state's keys (0 when none match)."""
    found = [int(m.group(1)) for k in state if (m := re.fullmatch(pattern, k))]
    return max(found) + 1 if found else 0


def load_medusa(path: str | Path, target_model: LlamaForCausalLM, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32) -> MedusaHeads:
    """Load Medusa heads for ``target_model``; CheckpointError when they do not fit."""
    hf, state = read_head(path, MEDUSA_FILES + WEIGHT_FILES)
    target = target_model.config
    for key, value in (("hidden_size", target.hidden_size), ("vocab_size", target.vocab_size)):
        if key in hf:
            check_fits(key, hf[key], value, path)
    num_heads = hf.get("medusa_num_heads") or _count(state, r"(\d+)\..*")
    num_layers = hf.get("medusa_num_layers") or _count(state, r"\d+\.(\d+)\.linear\.weight")
    if num_heads < 1:
        raise CheckpointError(f"head {path}: no Medusa heads found (keys like 0.0.linear.weight, 0.1.weight)")
    with torch.device("meta"):
        heads = MedusaHeads(target.hidden_size, target.vocab_size, num_heads, num_layers)
    assign_state(heads, state, path, device=device, dtype=dtype)
    return heads.to(device).eval()


def save_medusa(heads: MedusaHeads, path: str | Path, format: Format = "safetensors",
                base_model_name_or_path: str | None = None) -> Path:
    """Write the heads as Medusa saves them: config.json + medusa_lm_head.safetensors (or .pt)."""
    hf = {"medusa_num_heads": heads.num_heads, "medusa_num_layers": heads.num_layers,
          "hidden_size": heads.hidden_size, "vocab_size": heads.vocab_size,
          "base_model_name_or_path": base_model_name_or_path}
    return write_head(path, hf, checkpoint_state(heads), format=format, file_names=MEDUSA_FILES)
