"""Tree-mask attention over the paged prefix, and KV compaction, against a contiguous reference."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specflow.runtime.attention import ForwardBatch, TorchBackend
from specflow.runtime.kv_cache import PagedKVCache
from specflow.tree import ancestor_mask

HQ, HKV, D = 4, 2, 8


def reference_attention(q, k, v, mask):
    """q [q, Hq, D], k/v [kv, Hkv, D], mask [q, kv] -> [q, Hq, D], written out plainly."""
    k = k.repeat_interleave(HQ // HKV, dim=1)
    v = v.repeat_interleave(HQ // HKV, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / D**0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def extend(cache, backend, rids, lens, positions, masks, g):
    prefix = [cache.kv_lens.get(r, 0) for r in rids]
    cache.reserve(rids, [p + n for p, n in zip(prefix, lens)])
    batch = ForwardBatch.build(cache, rids, prefix, lens, torch.cat(positions), masks)
    backend.plan(batch)
    t = sum(lens)
    q, k, v = torch.randn(t, HQ, D, generator=g), torch.randn(t, HKV, D, generator=g), torch.randn(t, HKV, D, generator=g)
    out = backend.forward(0, q, k, v)
    for r, p, n in zip(rids, prefix, lens):
        cache.kv_lens[r] = p + n
    return q, k, v, out


def random_parents(n, g):
    return [-1] + [int(torch.randint(0, i, (), generator=g)) for i in range(1, n)]


@settings(max_examples=40, deadline=None)
@given(page_size=st.sampled_from([1, 3, 16]), seed=st.integers(0, 2**16),
       prefix_lens=st.lists(st.integers(1, 20), min_size=1, max_size=4),
       tree_sizes=st.data())
def test_tree_attention_and_commit_match_contiguous(page_size, seed, prefix_lens, tree_sizes):
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(1, HKV, D, num_pages=200, page_size=page_size)
    backend = TorchBackend(cache)
    rids = list(range(len(prefix_lens)))
    # prefill: causal over each prompt
    pos = [torch.arange(n) for n in prefix_lens]
    q, k, v, out = extend(cache, backend, rids, prefix_lens, pos, [None] * len(rids), g)
    start = 0
    for n in prefix_lens:
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        ref = reference_attention(q[start:start + n], k[start:start + n], v[start:start + n], causal)
        torch.testing.assert_close(out[start:start + n], ref)
        start += n
    prefix_k = [k[o:o + n] for o, n in zip([sum(prefix_lens[:i]) for i in range(len(rids))], prefix_lens)]
    prefix_v = [v[o:o + n] for o, n in zip([sum(prefix_lens[:i]) for i in range(len(rids))], prefix_lens)]

    # verification: one tree per request over its paged prefix
    sizes = [tree_sizes.draw(st.integers(1, 12)) for _ in rids]
    parents = [torch.tensor(random_parents(n, g)) for n in sizes]
    masks = [ancestor_mask(p[None])[0] for p in parents]
    depths = [m.sum(-1) - 1 for m in masks]
    positions = [p + d for p, d in zip(prefix_lens, depths)]
    q, k, v, out = extend(cache, backend, rids, sizes, positions, masks, g)
    start, keeps = 0, []
    for r, n in enumerate(sizes):
        p = prefix_lens[r]
        full_k = torch.cat([prefix_k[r], k[start:start + n]])
        full_v = torch.cat([prefix_v[r], v[start:start + n]])
        mask = torch.cat([torch.ones(n, p, dtype=torch.bool), masks[r]], dim=1)
        torch.testing.assert_close(out[start:start + n], reference_attention(q[start:start + n], full_k, full_v, mask))
        node = int(torch.randint(0, n, (), generator=g))  # a random root-to-node path to commit
        path = []
        while node >= 0:
            path.append(node)
            node = int(parents[r][node])
        keeps.append(path[::-1])
        start += n

    # commit every request's path at once: the cache must read prefix + accepted nodes, contiguous
    cache.commit(rids, prefix_lens, keeps)
    start = 0
    for r, (n, keep) in enumerate(zip(sizes, keeps)):
        p = prefix_lens[r]
        slots = cache.slots(r, 0, p + len(keep))
        torch.testing.assert_close(cache.k[0][slots], torch.cat([prefix_k[r], k[start:start + n][keep]]))
        torch.testing.assert_close(cache.v[0][slots], torch.cat([prefix_v[r], v[start:start + n][keep]]))
        assert len(cache.block_tables[r]) == cache.pages_needed(p + len(keep))
        start += n


def test_sliding_window_masks_far_keys():
    g = torch.Generator().manual_seed(0)
    cache = PagedKVCache(1, HKV, D, num_pages=64, page_size=1)
    backend = TorchBackend(cache, sliding_window=3)
    q, k, v, out = extend(cache, backend, [0], [8], [torch.arange(8)], [None], g)
    window = torch.ones(8, 8, dtype=torch.bool).tril() & ~torch.ones(8, 8, dtype=torch.bool).tril(-3)
    torch.testing.assert_close(out, reference_attention(q, k, v, window))
