"""Rotary position embeddings (RoPE) with the Llama-family scalings, numerically as in transformers.

``rope_scaling`` is the normalised dict of :class:`~specflow.models.config.ModelConfig`:
``None`` for plain RoPE, else ``{"rope_type": "linear" | "llama3", ...parameters}``.
Frequencies and angles are computed in float32 and only the final cos/sin are cast.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor, nn

ROPE_PARAMETERS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def check_rope_scaling(rope_scaling: dict | None) -> None:
    """Raise NotImplementedError for a RoPE type we do not implement, ValueError for missing keys."""
    if rope_scaling is None:
        return
    rope_type = rope_scaling.get("rope_type")
    if rope_type not in ROPE_PARAMETERS:
        raise NotImplementedError(
            f"rope_scaling type {rope_type!r} is not implemented; supported types: "
            f"{', '.join(ROPE_PARAMETERS)}")
    missing = [k for k in ROPE_PARAMETERS[rope_type] if k not in rope_scaling]
    if missing:
        raise ValueError(f"rope_scaling of type {rope_type!r} lacks {', '.join(missing)}: "
                         f"add them to the config's rope_scaling / rope_parameters")


def rope_inv_freq(head_dim: int, rope_theta: float, rope_scaling: dict | None = None) -> Tensor:
    """[head_dim // 2] float32 inverse frequencies on the CPU (also when built under a meta device)."""
    check_rope_scaling(rope_scaling)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim
    inv_freq = 1.0 / (rope_theta ** exponents)
    rope_type = rope_scaling["rope_type"] if rope_scaling else "default"
    if rope_type == "linear":
        inv_freq = inv_freq / rope_scaling["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)
    return inv_freq


def _llama3_inv_freq(inv_freq: Tensor, s: dict) -> Tensor:
    """Llama 3.1: long wavelengths divided by ``factor``, short ones kept, a smooth ramp between."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_context_len = s["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low
    high_freq_wavelen = old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for arbitrary (per-token) positions; no cache, so tree depths are free."""

    def __init__(self, head_dim: int, rope_theta: float, rope_scaling: dict | None = None):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, rope_theta, rope_scaling),
                             persistent=False)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> "Rotary":
        """positions [T] -> the forward's tables, cos and sin [T, D] in ``dtype`` (angles in float32)."""
        freqs = positions[:, None].float() * self.inv_freq.float()   # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)                       # [T, D]
        return Rotary(emb.cos().to(dtype), emb.sin().to(dtype))


@dataclass
class Rotary:
    """One forward's rotary tables, shared by its layers: ``cos`` and ``sin`` [T, D] (unpack as
    ``cos, sin = rotary``), and flashinfer's inputs built on first use, once per forward."""

    cos: Tensor
    sin: Tensor

    def __iter__(self) -> Iterator[Tensor]:
        return iter((self.cos, self.sin))

    @cached_property
    def cos_sin_cache(self) -> Tensor:
        """[T, D] float32: the cos halves, then the sin halves (cos/sin repeat their halves)."""
        half = self.cos.shape[-1] // 2
        return torch.cat((self.cos[:, :half], self.sin[:, :half]), dim=-1).float()

    @cached_property
    def rows(self) -> Tensor:
        """[T] token t reads row t of ``cos_sin_cache``."""
        return torch.arange(self.cos.shape[0], device=self.cos.device)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, H, D], cos/sin [T, D] -> [T, H, D] (rotate-half convention of HF checkpoints)."""
    cos, sin = cos[:, None], sin[:, None]                             # [T, 1, D]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
