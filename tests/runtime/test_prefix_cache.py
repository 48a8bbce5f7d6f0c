"""Prefix caching's page index against a model of what every page holds: whatever requests come,
share, finish and evict, a matched page holds exactly the tokens it was matched for, no page is
held twice or lost, eviction never drops a page another table holds, and a prefix's match grows
only by the pages cached since its last."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from specflow.runtime.kv_cache import OutOfPages, PagedKVCache

# a request: tokens over a 3-token vocabulary (so that prefixes are shared), or a release
REQUESTS = st.lists(st.one_of(st.lists(st.integers(0, 2), min_size=1, max_size=12), st.integers(0, 7)),
                    min_size=1, max_size=40)


@settings(max_examples=300, deadline=None)
@given(REQUESTS, st.sampled_from([1, 2, 3]), st.integers(8, 40))
def test_matched_pages_hold_the_tokens_they_were_matched_for(ops, page_size, num_pages):
    cache = PagedKVCache(1, 1, 1, num_pages=num_pages, page_size=page_size, prefix_caching=True)
    holds = np.full(num_pages * page_size, -1)             # the token each slot holds (-1: none)
    running: list[int] = []
    last_match: dict[tuple[int, ...], tuple[int, int]] = {}  # tokens -> (pages matched, num_inserted then)
    for rid, op in enumerate(ops):
        if isinstance(op, int):                            # a running request finishes
            if running:
                done = running.pop(op % len(running))
                cache.release(done)
            continue
        tokens = op
        matched = cache.match(rid, tokens[:-1])
        assert matched % page_size == 0 and matched <= len(tokens) - 1
        if tuple(tokens) in last_match:  # a match grows only by the pages cached since (Scheduler's bound)
            pages, inserted = last_match[tuple(tokens)]
            assert matched // page_size <= pages + cache.prefix.num_inserted - inserted
        last_match[tuple(tokens)] = matched // page_size, cache.prefix.num_inserted
        if matched:
            assert holds[cache.batch_slot_array([rid], [matched])[0]].tolist() == tokens[:matched]
        try:
            cache.reserve([rid], [len(tokens)])
        except OutOfPages:
            cache.release(rid)
            continue
        slots = cache.batch_slot_array([rid], [len(tokens)], matched)[0]
        holds[slots] = tokens[matched:]                    # the prefill writes the rest
        cache.kv_lens[rid] = len(tokens)
        cache.insert(rid, tokens)
        running.append(rid)
        check_accounting(cache, running)
    for rid in running:
        cache.release(rid)
    check_accounting(cache, [])


def check_accounting(cache: PagedKVCache, running: list[int]) -> None:
    """Every page is free, held by tables (shared only when cached), or cached and evictable."""
    free = set(cache.allocator._free[:cache.allocator.num_free].tolist())
    held = [p for r in running for p in cache.block_tables[r].pages.tolist()]
    shared = {p for p in held if held.count(p) > 1}
    assert all(cache.prefix.is_cached(p) for p in shared)
    evictable = set(cache.prefix._evictable)
    assert not (free & set(held)) and not (free & evictable) and not (evictable & set(held))
    assert len(free) + len(set(held)) + len(evictable) == cache.allocator.num_pages


def test_a_page_is_evicted_before_its_parent_and_only_when_no_table_holds_it():
    cache = PagedKVCache(1, 1, 1, num_pages=6, page_size=2, prefix_caching=True)
    cache.reserve([0], [6])
    cache.kv_lens[0] = 6
    cache.insert(0, [1, 2, 3, 4, 5, 6])                  # three cached pages: a chain
    first, second, third = cache.block_tables[0].pages.tolist()
    cache.release(0)
    assert cache.match(1, [1, 2, 3, 4]) == 4             # the first two pages, held again
    cache.reserve([2], [6])                              # the 3 free pages
    cache.reserve([2], [7])                              # one more: the chain's last, the only evictable one
    assert cache.prefix.num_evictable == 0 and not cache.prefix.is_cached(third)
    assert cache.match(3, [1, 2, 3, 4, 5, 6]) == 4
    cache.release(3)
    cache.release(1)
    evicted = cache.prefix.evict(2).tolist()
    assert evicted == [second, first]
