"""Paged KV cache: a block allocator with a free list, per-request block tables, slot mapping.

A request's cached tokens occupy logical indices 0..kv_len-1; logical index i lives in slot
``block_table[i // page_size] * page_size + i % page_size`` of every layer's pool. Tree nodes
of a verification step are written at logical indices kv_len .. kv_len + N - 1 (scratch), and
``commit`` moves the accepted ones to contiguous indices and frees pages that became empty.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch
from torch import Tensor


class OutOfPages(RuntimeError):
    """The KV pool cannot hold the requested tokens. Nothing was allocated; the engine queues
    or preempts a request and tries again."""


class BlockAllocator:
    """A free list of page ids."""

    def __init__(self, num_pages: int):
        assert num_pages >= 1
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"need {n} KV pages, {len(self._free)} of {self.num_pages} free")
        return [self._free.popleft() for _ in range(n)]

    def free(self, pages: list[int]) -> None:
        self._free.extend(pages)
        assert len(self._free) <= self.num_pages, "double free"


class PagedKVCache:
    """One K and one V pool for all layers: ``k[layer]`` is ``[num_pages * page_size, Hkv, D]``."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_pages: int,
                 page_size: int = 1, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        assert page_size >= 1
        self.page_size = page_size
        self.allocator = BlockAllocator(num_pages)
        shape = (num_layers, num_pages * page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_tables: dict[int, list[int]] = {}
        self.kv_lens: dict[int, int] = {}

    @property
    def num_pages_used(self) -> int:
        return self.allocator.num_pages - self.allocator.num_free

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def reserve(self, request_ids: list[int], num_tokens: list[int]) -> None:
        """Make each request's block table cover ``num_tokens`` logical indices; all or nothing."""
        extra = [max(0, self.pages_needed(n) - len(self.block_tables.get(r, [])))
                 for r, n in zip(request_ids, num_tokens)]
        if sum(extra) > self.allocator.num_free:
            raise OutOfPages(f"need {sum(extra)} more KV pages, {self.allocator.num_free} free")
        for r, e in zip(request_ids, extra):
            table = self.block_tables.setdefault(r, [])
            self.kv_lens.setdefault(r, 0)
            table.extend(self.allocator.allocate(e))

    def slots(self, request_id: int, start: int, end: int) -> Tensor:
        """[end - start] slot ids of logical indices start..end-1 (must be reserved)."""
        return self.batch_slots([request_id], [end], start)[0]

    def batch_slots(self, request_ids: list[int], kv_lens: list[int], start: int = 0) -> Tensor:
        """[B, max(kv_lens) - start] slot ids of logical indices start..kv_len-1 per request
        (0 past the end). Built in numpy: converting Python lists is several times cheaper there."""
        tables = [self.block_tables[r] for r in request_ids]
        table = np.zeros((len(tables), max(map(len, tables))), dtype=np.int64)          # [B, pages]
        for row, t in zip(table, tables):
            row[: len(t)] = t
        idx = np.arange(start, max(kv_lens))
        slots = table[:, idx // self.page_size] * self.page_size + idx % self.page_size    # [B, max_kv]
        slots[idx[None] >= np.array(kv_lens)[:, None]] = 0
        return torch.from_numpy(np.ascontiguousarray(slots))

    def commit(self, request_id: int, base: int, keep: list[int]) -> None:
        """Keep the tokens at logical indices ``base + keep[j]`` as ``base + j``; drop the rest.

        ``keep`` is increasing (an accepted tree path, root first), so moving in order never
        overwrites a source before it is read. Pages past the new length return to the pool.
        """
        assert all(a < b for a, b in zip(keep, keep[1:])), "keep must be increasing"
        moved = [(o, j) for j, o in enumerate(keep) if o != j]
        if moved:
            src = self.slots(request_id, base, base + keep[-1] + 1)[[o for o, _ in moved]]
            dst = self.slots(request_id, base, base + len(keep))[[j for _, j in moved]]
            dst = dst.to(self.k.device)
            self.k[:, dst] = self.k[:, src.to(self.k.device)]
            self.v[:, dst] = self.v[:, src.to(self.v.device)]
        self.truncate(request_id, base + len(keep))

    def truncate(self, request_id: int, kv_len: int) -> None:
        """Set the request's cached length and free the pages beyond it."""
        table = self.block_tables[request_id]
        keep_pages = self.pages_needed(kv_len)
        self.allocator.free(table[keep_pages:])
        del table[keep_pages:]
        self.kv_lens[request_id] = kv_len

    def release(self, request_id: int) -> None:
        """Return all of a request's pages to the pool."""
        self.allocator.free(self.block_tables.pop(request_id, []))
        self.kv_lens.pop(request_id, None)
