"""Prefix caching: full KV pages of committed tokens, shared by every request whose sequence
starts with the same tokens (vLLM's automatic prefix caching, SGLang's radix cache, at page
granularity).

A cached page is keyed by its parent page (the cached page before it; for the first, a root:
-1, or a negative number that names what precedes the first page, as an EAGLE head's entries
follow the sequence's first token) and its tokens, so a key names the whole prefix up to the
page's end and a lookup compares token ids exactly (no hash can collide). Block tables hold cached pages by reference; a cached page no
table holds stays in the pool, *evictable*, until the allocator needs it, least recently
released first. A table's pages are released last page first, and a table holding a page holds
its parents, so a page is always evicted before its parent: no key ever names a page id that was
freed and reused.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np


class PrefixCache:
    """The index of cached pages and their reference counts (PagedKVCache owns the pages)."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self._page: dict[tuple[int, tuple[int, ...]], int] = {}   # (parent page, its tokens) -> page
        self._key: dict[int, tuple[int, tuple[int, ...]]] = {}     # cached page -> its key
        self._children: dict[int, int] = {}                       # cached page -> cached pages keyed by it
        self._refs: dict[int, int] = {}                           # cached page -> block tables holding it
        self._evictable: OrderedDict[int, None] = OrderedDict()   # cached pages no table holds, LRU first
        self.num_inserted = 0  # pages ever cached: a prefix's match grows only by pages cached since

    @property
    def num_cached(self) -> int:
        return len(self._key)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def is_cached(self, page: int) -> bool:
        return page in self._key

    def match(self, tokens: Sequence[int], root: int = -1) -> list[int]:
        """The cached pages of the longest prefix of ``tokens`` made of full pages, taken by
        one more table each."""
        pages, parent, ps = [], root, self.page_size
        for start in range(0, len(tokens) - ps + 1, ps):
            page = self._page.get((parent, tuple(tokens[start:start + ps])))
            if page is None:
                break
            pages.append(page)
            parent = page
        for page in pages:
            self._refs[page] += 1
            self._evictable.pop(page, None)
        return pages

    def insert(self, pages: np.ndarray, tokens: Sequence[int], root: int = -1) -> None:
        """Cache a table's ``pages`` holding ``tokens`` (full pages of committed tokens, from the
        table's first page): those not cached yet become cached, held by this table. Stops at a
        page whose prefix another page holds already (a request that computed it alongside)."""
        parent, ps = root, self.page_size
        for i, page in enumerate(pages.tolist()):
            key = (parent, tuple(tokens[i * ps:(i + 1) * ps]))
            if page not in self._key:
                if key in self._page:
                    return
                self._page[key], self._key[page], self._refs[page], self._children[page] = page, key, 1, 0
                self.num_inserted += 1
                if parent >= 0:
                    self._children[parent] += 1
            parent = page

    def release(self, pages: np.ndarray) -> np.ndarray:
        """A table lets go of its ``pages``: cached ones are held by one table fewer (evictable
        at none, last page first); returns the others, to be freed."""
        owned = []
        for page in reversed(pages.tolist()):
            if page not in self._key:
                owned.append(page)
                continue
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._evictable[page] = None
        return np.array(owned, dtype=np.int64)

    def evict(self, n: int) -> np.ndarray:
        """Up to ``n`` evictable pages, least recently released first, dropped from the index
        (to be freed)."""
        evicted = []
        while len(evicted) < n and self._evictable:
            page, _ = self._evictable.popitem(last=False)
            assert self._children[page] == 0, "a page is evicted after its children"
            parent, _ = key = self._key.pop(page)
            del self._page[key], self._refs[page], self._children[page]
            if parent >= 0:
                self._children[parent] -= 1
            evicted.append(page)
        return np.array(evicted, dtype=np.int64)
