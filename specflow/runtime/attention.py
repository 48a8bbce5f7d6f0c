"""Attention backends: plan once per forward, run per layer.

Every forward is an *extend*: request r has ``prefix_lens[r]`` tokens already cached and
appends ``qo_lens[r]`` new tokens at logical indices prefix_len .. prefix_len + qo_len - 1.
New tokens see the whole prefix and, among themselves, either a causal mask (prefill, decode)
or a per-request tree mask (verification). A tree mask ``[q, m]`` with m >= q covers the last m
visible tokens (earlier scratch tree nodes, then the new ones), so a drafter expanding a tree
level by level lets each node see only its ancestors. Plain decode is qo_len = 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from specflow.runtime.kv_cache import PagedKVCache


@dataclass
class ForwardBatch:
    """The token-flat layout of one forward (request-major)."""

    request_ids: list[int]
    positions: Tensor                 # [T] rope positions of the new tokens
    prefix_lens: list[int]            # cached tokens per request before this forward
    qo_lens: list[int]                # new tokens per request
    tree_masks: list[Tensor | None]   # per request [q, m >= q] bool over the last m tokens; None = causal
    slot_mapping: Tensor              # [T] pool slot each new token's K/V is written to
    kv_slots: list[Tensor]            # per request [prefix + q] slots of every visible token


class AttentionBackend(Protocol):
    def plan(self, batch: ForwardBatch) -> None: ...
    def forward(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor: ...


class TorchBackend:
    """Portable reference backend (CPU and CUDA, any mask): pad the batch to ``[B, max_q]``
    queries over ``[B, max_kv]`` gathered keys and call scaled_dot_product_attention."""

    def __init__(self, cache: PagedKVCache, sliding_window: int | None = None):
        self.cache = cache
        self.sliding_window = sliding_window

    def plan(self, batch: ForwardBatch) -> None:
        device = self.cache.k.device
        b = len(batch.request_ids)
        max_q = max(batch.qo_lens)
        kv_lens = [p + q for p, q in zip(batch.prefix_lens, batch.qo_lens)]
        max_kv = max(kv_lens)
        kv_index = torch.zeros(b, max_kv, dtype=torch.long)
        mask = torch.zeros(b, max_q, max_kv, dtype=torch.bool)
        q_rows = []  # flat token t -> padded row b * max_q + i
        key_pos = torch.zeros(b, max_kv, dtype=torch.long)
        query_pos = torch.zeros(b, max_q, dtype=torch.long)
        start = 0
        for r, (p, q) in enumerate(zip(batch.prefix_lens, batch.qo_lens)):
            kv_index[r, : p + q] = batch.kv_slots[r]
            own = batch.tree_masks[r]
            if own is None:
                own = torch.ones(q, q, dtype=torch.bool).tril_()
            m = own.shape[1]
            mask[r, :q, : p + q - m] = True
            mask[r, :q, p + q - m : p + q] = own
            mask[r, q:, 0] = True  # padded query rows attend to something; their output is dropped
            pos = batch.positions[start : start + q].cpu()
            key_pos[r, :p] = torch.arange(p)  # sliding windows assume committed tokens at their index
            key_pos[r, p : p + q] = pos
            query_pos[r, :q] = pos
            q_rows.append(torch.arange(q) + r * max_q)
            start += q
        if self.sliding_window is not None:
            mask &= (query_pos[:, :, None] - key_pos[:, None, :]) < self.sliding_window
            for r, q in enumerate(batch.qo_lens):
                mask[r, q:, 0] = True
        self.batch = batch
        self.shape = (b, max_q, max_kv)
        self.kv_index = kv_index.to(device)                  # [B, max_kv]
        # additive float mask: sdpa's CPU kernels are several times faster with it than with bool
        bias = torch.zeros(mask.shape, dtype=self.cache.k.dtype).masked_fill_(~mask, float("-inf"))
        self.mask = bias[:, None].to(device)                 # [B, 1, max_q, max_kv]
        self.q_rows = torch.cat(q_rows).to(device)           # [T]
        self.slot_mapping = batch.slot_mapping.to(device)    # [T]

    def forward(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]; writes k/v into the cache first."""
        k_pool, v_pool = self.cache.k[layer], self.cache.v[layer]
        k_pool.index_copy_(0, self.slot_mapping, k.to(k_pool.dtype))
        v_pool.index_copy_(0, self.slot_mapping, v.to(v_pool.dtype))
        b, max_q, max_kv = self.shape
        t, hq, d = q.shape
        q_pad = q.new_zeros(b * max_q, hq, d).index_copy_(0, self.q_rows, q)
        q_pad = q_pad.view(b, max_q, hq, d).transpose(1, 2)      # [B, Hq, max_q, D]
        flat = self.kv_index.view(-1)  # index_select: far faster than advanced indexing on CPU
        keys = k_pool.index_select(0, flat).view(b, max_kv, *k_pool.shape[1:]).transpose(1, 2)    # [B, Hkv, max_kv, D]
        values = v_pool.index_select(0, flat).view(b, max_kv, *v_pool.shape[1:]).transpose(1, 2)  # [B, Hkv, max_kv, D]
        out = F.scaled_dot_product_attention(q_pad, keys.to(q.dtype), values.to(q.dtype),
                                             attn_mask=self.mask.to(q.dtype), enable_gqa=True)
        out = out.transpose(1, 2).reshape(b * max_q, hq, d)        # [B * max_q, Hq, D]
        return out.index_select(0, self.q_rows)                    # [T, Hq, D]


BACKENDS = {"torch": TorchBackend}
