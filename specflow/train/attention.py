"""Attention backends for training: dense ``[B, S]`` batches, no KV cache.

The native models are token-flat (``q [T, H, D]`` with ``T = B * S``) and delegate attention to a
backend's ``forward(layer, q, k, v)``; these backends give them plain causal attention over
fixed-length sequences, which is what every training recipe needs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor


class CausalAttention:
    """Causal self-attention over ``batch`` sequences of ``seq_len`` tokens each; with a
    ``sliding_window`` (Mistral), each query sees only the ``sliding_window`` latest keys up to
    itself, as at inference."""

    def __init__(self, batch: int, seq_len: int, sliding_window: int | None = None):
        self.batch = batch
        self.seq_len = seq_len
        self.sliding_window = sliding_window if sliding_window is not None and sliding_window < seq_len else None

    def forward(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q [B*S, Hq, D], k/v [B*S, Hkv, D] -> [B*S, Hq, D]."""
        q, k, v = (rearrange(x, "(b s) h d -> b h s d", b=self.batch) for x in (q, k, v))
        if self.sliding_window is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # [B, Hq, S, D]
        else:
            pos = torch.arange(self.seq_len, device=q.device)
            behind = pos[:, None] - pos[None, :]                                        # [S, S] query - key
            mask = (behind >= 0) & (behind < self.sliding_window)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)  # [B, Hq, S, D]
        return rearrange(out, "b h s d -> (b s) h d")


class UnrolledAttention:
    """Training-time test (EAGLE-3): the head runs ``step = 0, 1, ...`` times over the same rows.

    Step 0 is causal over the rows (the committed context, read from target features). At step
    k >= 1, row j is the depth-k draft node below row j's root: it sees the step-0 keys of rows
    <= j and, of the later steps, only its own ancestors, i.e. the keys of row j at steps 1..k.
    Each forward is the next step. One attention layer (``layer`` 0) only.
    """

    def __init__(self, batch: int, seq_len: int):
        self.batch = batch
        self.seq_len = seq_len
        self.keys: list[Tensor] = []      # per step [B, Hq, S, D]
        self.values: list[Tensor] = []

    def forward(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q [B*S, Hq, D], k/v [B*S, Hkv, D] -> [B*S, Hq, D]."""
        assert layer == 0, "UnrolledAttention serves a one-layer head"
        q, k, v = (rearrange(x, "(b s) h d -> b h s d", b=self.batch) for x in (q, k, v))
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))  # GQA -> [B, Hq, S, D]
        self.keys.append(k)
        self.values.append(v)
        if len(self.keys) == 1:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)            # [B, Hq, S, D]
            return rearrange(out, "b h s d -> (b s) h d")
        scale = q.shape[-1] ** -0.5
        s = self.seq_len
        causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        context = (q @ self.keys[0].transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))  # [B, Hq, S, S]
        diag_k = torch.stack(self.keys[1:], dim=-2)                                   # [B, Hq, S, k, D]
        diag_v = torch.stack(self.values[1:], dim=-2)
        own = torch.einsum("bhsd,bhskd->bhsk", q, diag_k) * scale                   # [B, Hq, S, k]
        w = torch.cat([context, own], -1).float().softmax(-1).to(q.dtype)            # [B, Hq, S, S + k]
        out = w[..., :s] @ self.values[0] + torch.einsum("bhsk,bhskd->bhsd", w[..., s:], diag_v)
        return rearrange(out, "b h s d -> (b s) h d")
