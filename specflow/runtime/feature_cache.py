"""The target features of every token in a target's KV cache, by KV slot: with prefix caching, a
request whose prefix is cached gives its drafter (EAGLE heads, Medusa) the features of tokens it
did not compute."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from specflow.runtime.kv_cache import PagedKVCache
from specflow.runtime.transfer import to_device


class FeatureCache:
    """One pool per feature the drafter reads (``widths``: H for hidden states, taps x H for
    EAGLE-3 taps; None where it reads none), [num_slots, width] each, beside the K/V of ``cache``:
    about H / (2 x layers x kv_heads x head_dim) of it per feature (6 % for Llama-3-8B's hidden
    states). Pages are not copied when the KV cache compacts a tree: features are written where
    their tokens' K/V end up."""

    def __init__(self, cache: PagedKVCache, widths: tuple[int | None, ...], dtype: torch.dtype):
        self.cache = cache
        num_slots = cache.k.shape[1]
        self.pools = [None if w is None else torch.zeros(num_slots, w, dtype=dtype, device=cache.k.device)
                      for w in widths]

    def write(self, request_ids: list[int], starts: list[int], counts: list[int],
              features: tuple[Tensor | None, ...]) -> None:
        """Features [T, width] (token-flat, request-major) of each request's ``count`` tokens at
        logical indices ``start ..``: one scatter per pool."""
        if not sum(counts):
            return
        slots = np.concatenate([self.cache.batch_slot_array([r], [s + n], s)[0]
                                for r, s, n in zip(request_ids, starts, counts) if n])
        index, = to_device([torch.from_numpy(slots)], self.cache.k.device)
        for pool, x in zip(self.pools, features):
            if pool is not None:
                pool.index_copy_(0, index, x.to(pool.dtype))

    def read(self, request_id: int, n: int) -> tuple[Tensor | None, ...]:
        """The features [n, width] of the request's tokens at logical indices 0 .. n - 1."""
        index, = to_device([torch.from_numpy(self.cache.batch_slot_array([request_id], [n])[0])],
                           self.cache.k.device)
        return tuple(None if pool is None else pool[index] for pool in self.pools)
