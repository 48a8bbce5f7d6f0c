"""Allocator and block-table invariants under random reserve / commit / release sequences."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specflow.runtime.kv_cache import BlockAllocator, OutOfPages, PagedKVCache


def tables(cache: PagedKVCache) -> dict[int, list[int]]:
    return {r: t.pages.tolist() for r, t in cache.block_tables.items()}


def check_invariants(cache: PagedKVCache) -> None:
    owned = [p for table in cache.block_tables.values() for p in table.pages.tolist()]
    assert len(owned) == len(set(owned)), "a page is owned twice"
    free = cache.allocator._free[: cache.allocator.num_free].tolist()
    assert not set(owned) & set(free), "an owned page is on the free list"
    assert len(owned) + len(free) == cache.allocator.num_pages
    for r, table in cache.block_tables.items():
        assert len(table) * cache.page_size >= cache.kv_lens[r]
        if cache.kv_lens[r]:  # the incrementally kept slot rows agree with the block table
            assert torch.equal(cache.batch_slots([r], [cache.kv_lens[r]])[0], cache.slots(r, 0, cache.kv_lens[r]))


ops = st.lists(st.tuples(st.sampled_from(["reserve", "commit", "release"]),
                         st.integers(0, 3), st.integers(1, 40), st.integers(0, 2**16)), max_size=40)


@settings(max_examples=150, deadline=None)
@given(ops=ops, page_size=st.sampled_from([1, 4, 16]), num_pages=st.integers(1, 40))
def test_allocator_invariants(ops, page_size, num_pages):
    cache = PagedKVCache(1, 1, 2, num_pages, page_size)
    for op, rid, n, seed in ops:
        before = (tables(cache), dict(cache.kv_lens), cache.allocator.num_free)
        if op == "reserve":
            kv = cache.kv_lens.get(rid, 0)
            try:
                cache.reserve([rid], [kv + n])
                cache.kv_lens[rid] = kv + n
            except OutOfPages:
                # a failed reservation changes nothing
                assert (tables(cache), cache.kv_lens, cache.allocator.num_free) == before
        elif op == "commit" and rid in cache.kv_lens and cache.kv_lens[rid] > 0:
            kv = cache.kv_lens[rid]
            g = torch.Generator().manual_seed(seed)
            base = int(torch.randint(0, kv, (), generator=g))
            extra = torch.randperm(kv - base - 1, generator=g)[: int(torch.randint(0, kv - base, (), generator=g))]
            keep = [0] + sorted(int(x) + 1 for x in extra)
            cache.commit([rid], [base], [keep])
            assert cache.kv_lens[rid] == base + len(keep)
            assert len(cache.block_tables[rid]) == cache.pages_needed(base + len(keep))
        elif op == "release":
            cache.release(rid)
            assert rid not in cache.block_tables
        check_invariants(cache)
    for rid in list(cache.block_tables):
        cache.release(rid)
    assert cache.allocator.num_free == num_pages


def test_out_of_pages_is_all_or_nothing():
    cache = PagedKVCache(1, 1, 2, num_pages=4, page_size=2)
    cache.reserve([0], [4])
    with pytest.raises(OutOfPages, match="need 3 more KV pages, 2 free"):
        cache.reserve([1, 2], [2, 4])
    assert cache.allocator.num_free == 2 and 1 not in cache.block_tables and 2 not in cache.block_tables


def test_allocator_double_free_is_caught():
    alloc = BlockAllocator(2)
    pages = alloc.allocate(1)
    alloc.free(pages)
    with pytest.raises(AssertionError):
        alloc.free([*pages, *pages])


@pytest.mark.parametrize("page_size", [1, 4])
def test_batch_slot_array_is_batch_slots_as_numpy(page_size):
    """Slots of logical indices start..kv_len-1 per request, 0 past each request's end."""
    cache = PagedKVCache(1, 1, 2, 32, page_size)
    cache.reserve([0, 1, 2], [9, 3, 14])
    for start in (0, 2):
        array = cache.batch_slot_array([0, 1, 2], [9, 3, 14], start)
        assert array.shape == (3, 14 - start) and array.flags.c_contiguous
        assert torch.equal(torch.from_numpy(array), cache.batch_slots([0, 1, 2], [9, 3, 14], start))
        for row, (r, n) in zip(array, [(0, 9), (1, 3), (2, 14)]):
            assert row[: n - start].tolist() == cache.slots(r, start, n).tolist()
            assert not row[n - start :].any()
