"""Paged KV cache: a block allocator with a free list, per-request block tables, slot mapping.

A request's cached tokens occupy logical indices 0..kv_len-1; logical index i lives in slot
``block_table[i // page_size] * page_size + i % page_size`` of every layer's pool. Tree nodes
of a verification step are written at logical indices kv_len .. kv_len + N - 1 (scratch), and
``commit`` moves the accepted ones to contiguous indices and frees pages that became empty.

With ``prefix_caching``, full pages of committed tokens are shared between requests
(specflow.runtime.prefix_cache): ``match`` starts a request's table with the cached pages of its
longest cached prefix, ``insert`` caches a table's full pages, and pages no table holds stay
cached until an allocation needs them.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from specflow.runtime.prefix_cache import PrefixCache
from specflow.runtime.transfer import to_device


class OutOfPages(RuntimeError):
    """The KV pool cannot hold the requested tokens. Nothing was allocated; the engine queues
    or preempts a request and tries again."""


class BlockAllocator:
    """A free list of page ids: a numpy stack, so a batch's pages come and go as array slices."""

    def __init__(self, num_pages: int):
        assert num_pages >= 1
        self.num_pages = num_pages
        self._free = np.arange(num_pages - 1, -1, -1, dtype=np.int64)  # [num_pages] free ids in [: num_free]
        self.num_free = num_pages

    def allocate(self, n: int) -> np.ndarray:
        """[n] page ids."""
        if n > self.num_free:
            raise OutOfPages(f"need {n} KV pages, {self.num_free} of {self.num_pages} free")
        self.num_free -= n
        return self._free[self.num_free : self.num_free + n][::-1].copy()

    def free(self, pages: np.ndarray) -> None:
        assert self.num_free + len(pages) <= self.num_pages, "double free"
        self._free[self.num_free : self.num_free + len(pages)] = pages
        self.num_free += len(pages)


class BlockTable:
    """One request's page ids in logical order, in a numpy buffer that doubles when full: laying
    out a batch copies array slices instead of converting lists, whatever the context length."""

    def __init__(self):
        self._buf = np.zeros(16, dtype=np.int64)
        self._len = 0

    def __len__(self) -> int:
        return self._len

    @property
    def pages(self) -> np.ndarray:
        """[len] page ids (a view: valid until the next ``extend``)."""
        return self._buf[: self._len]

    def extend(self, pages: np.ndarray) -> None:
        end = self._len + len(pages)
        if end > len(self._buf):
            grown = np.zeros(max(end, 2 * len(self._buf)), dtype=np.int64)
            grown[: self._len] = self.pages
            self._buf = grown
        self._buf[self._len : end] = pages
        self._len = end

    def truncate(self, num_pages: int) -> np.ndarray:
        """Keep the first ``num_pages``; returns the others."""
        dropped = self._buf[num_pages : self._len].copy()
        self._len = min(self._len, num_pages)
        return dropped


class PagedKVCache:
    """One K and one V pool for all layers: ``k[layer]`` is ``[num_pages * page_size, Hkv, D]``."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_pages: int,
                 page_size: int = 1, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 prefix_caching: bool = False):
        assert page_size >= 1
        self.page_size = page_size
        self.allocator = BlockAllocator(num_pages)
        self.prefix = PrefixCache(page_size) if prefix_caching else None
        shape = (num_layers, num_pages * page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_tables: dict[int, BlockTable] = {}
        self.kv_lens: dict[int, int] = {}

    @property
    def num_pages_used(self) -> int:
        return self.allocator.num_pages - self.allocator.num_free

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @property
    def num_available(self) -> int:
        """Pages an allocation can take: the free ones and the cached ones no table holds."""
        return self.allocator.num_free + (self.prefix.num_evictable if self.prefix else 0)

    def fits(self, request_ids: list[int], num_tokens: list[int], cached: int = 0) -> bool:
        """Whether ``reserve(request_ids, num_tokens)`` would find the pages, when ``cached`` of
        them come from the prefix cache without costing any (a bound for a request not matched yet)."""
        return sum(self.extra_pages(request_ids, num_tokens)) - cached <= self.num_available

    def extra_pages(self, request_ids: list[int], num_tokens: list[int]) -> list[int]:
        """The pages each request's table lacks to cover ``num_tokens`` logical indices."""
        return [max(0, self.pages_needed(n) - len(self.block_tables.get(r, ())))
                for r, n in zip(request_ids, num_tokens)]

    def reserve(self, request_ids: list[int], num_tokens: list[int]) -> None:
        """Make each request's block table cover ``num_tokens`` logical indices; all or nothing."""
        extra = self.extra_pages(request_ids, num_tokens)
        if sum(extra) > self.num_available:
            raise OutOfPages(f"need {sum(extra)} more KV pages, {self.num_available} free")
        if sum(extra) > self.allocator.num_free:  # the least recently used cached pages go
            self.allocator.free(self.prefix.evict(sum(extra) - self.allocator.num_free))
        pages, start = self.allocator.allocate(sum(extra)), 0  # one allocation for the batch
        for r, e in zip(request_ids, extra):
            if r not in self.block_tables:
                self.block_tables[r], self.kv_lens[r] = BlockTable(), 0
            if e:
                self.block_tables[r].extend(pages[start : start + e])
                start += e

    def slots(self, request_id: int, start: int, end: int) -> Tensor:
        """[end - start] slot ids of logical indices start..end-1 (must be reserved)."""
        return self.batch_slots([request_id], [end], start)[0]

    def batch_slots(self, request_ids: list[int], kv_lens: list[int], start: int = 0) -> Tensor:
        """[B, max(kv_lens) - start] slot ids of logical indices start..kv_len-1 per request
        (0 past the end), from array copies of the block tables."""
        return torch.from_numpy(self.batch_slot_array(request_ids, kv_lens, start))

    def batch_slot_array(self, request_ids: list[int], kv_lens: list[int], start: int = 0) -> np.ndarray:
        """``batch_slots`` as a numpy array, for host layouts (no torch op, nor a ``.numpy()``)."""
        ps = self.page_size
        pages = [self.pages_needed(n) for n in kv_lens]
        table = np.zeros((len(request_ids), max(pages)), dtype=np.int64)                  # [B, pages]
        for row, r, n in zip(table, request_ids, pages):
            row[:n] = self.block_tables[r].pages[:n]
        if ps == 1:  # a slot is its page: rows are zero past kv_len already
            return np.ascontiguousarray(table[:, start:])
        slots = (table[:, :, None] * ps + np.arange(ps)).reshape(len(table), -1)           # [B, pages * ps]
        slots = np.ascontiguousarray(slots[:, start : max(kv_lens)])                        # [B, max_kv - start]
        for row, n in zip(slots, kv_lens):  # (row slices: cheaper than a boolean mask over the batch)
            row[max(n - start, 0):] = 0
        return slots

    def commit(self, request_ids: list[int], bases: list[int], keeps: list[list[int]]) -> None:
        """For each request, keep the tokens at logical indices ``base + keep[j]`` as ``base + j``
        and drop the rest: one gather and one write per pool for the whole batch. ``keep`` is
        increasing (an accepted tree path, root first). Pages past the new lengths return to
        the pool."""
        src, dst = [], []
        for r, base, keep in zip(request_ids, bases, keeps):
            assert all(a < b for a, b in zip(keep, keep[1:])), "keep must be increasing"
            moved = [j for j, o in enumerate(keep) if o != j]
            if moved:  # keep[j] >= j: the slots up to keep[-1] cover sources and destinations
                slots = self.batch_slot_array([r], [base + keep[-1] + 1], base)[0]
                src.append(slots[[keep[j] for j in moved]])
                dst.append(slots[moved])
        if src:
            index, = to_device([torch.from_numpy(np.stack([np.concatenate(src), np.concatenate(dst)]))],
                               self.k.device)                                            # [2, M]
            for pool in (self.k, self.v):
                pool[:, index[1]] = pool[:, index[0]]  # gathered before any write
        for r, base, keep in zip(request_ids, bases, keeps):
            table = self.block_tables[r]
            if keep == [0] and self.kv_lens[r] == base + 1 and len(table) == self.pages_needed(base + 1):
                continue  # a decode step's root: nothing to free
            self.truncate(r, base + len(keep))

    def truncate(self, request_id: int, kv_len: int) -> None:
        """Set the request's cached length and free the pages beyond it."""
        dropped = self.block_tables[request_id].truncate(self.pages_needed(kv_len))
        assert self.prefix is None or not any(map(self.prefix.is_cached, dropped.tolist())), \
            "a cached page holds committed tokens only"
        self.allocator.free(dropped)
        self.kv_lens[request_id] = kv_len

    def release(self, request_id: int) -> None:
        """Return all of a request's pages to the pool (cached ones stay cached)."""
        table = self.block_tables.pop(request_id, None)
        if table is not None:
            self.allocator.free(table.pages if self.prefix is None else self.prefix.release(table.pages))
        self.kv_lens.pop(request_id, None)

    def match(self, request_id: int, tokens: list[int], root: int = -1) -> int:
        """Start a new request's table with the cached pages of the longest prefix of ``tokens``
        made of full pages (after ``root``: PrefixCache); returns the tokens they hold (its
        cached length)."""
        assert request_id not in self.block_tables
        pages = self.prefix.match(tokens, root)
        if pages:
            self.block_tables[request_id], self.kv_lens[request_id] = BlockTable(), len(pages) * self.page_size
            self.block_tables[request_id].extend(np.array(pages, dtype=np.int64))
        return len(pages) * self.page_size

    def insert(self, request_id: int, tokens: list[int], root: int = -1) -> None:
        """Cache the request's full pages holding ``tokens``, its committed tokens from the first
        (at most its cached length of them; after ``root``: PrefixCache)."""
        n = min(len(tokens), self.kv_lens.get(request_id, 0)) // self.page_size
        if n:
            self.prefix.insert(self.block_tables[request_id].pages[:n], tokens[:n * self.page_size], root)
