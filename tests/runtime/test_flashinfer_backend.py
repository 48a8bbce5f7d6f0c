"""FlashinferBackend against the torch oracle: its mask and page table on CPU, its outputs on CUDA."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specflow.runtime.attention import ForwardBatch, TorchBackend
from specflow.runtime.flashinfer_backend import (FlashinferBackend, custom_mask, flashinfer_available,
                                                 flashinfer_supports, page_table, positions_are_indices)
from specflow.runtime.kv_cache import PagedKVCache
from specflow.tree import ancestor_mask
from tests.runtime.test_attention import HKV, D, random_parents

needs_flashinfer = pytest.mark.skipif(not flashinfer_available(), reason="needs CUDA and an importable flashinfer")


def tree_batch(cache, prefix_lens, tree_sizes, g, causal_every=3):
    """Reserve and lay out one verification forward: a random tree per request over its prefix
    (every ``causal_every``-th request a plain causal extend instead), depth positions."""
    rids = list(range(len(prefix_lens)))
    masks, positions = [], []
    for r, (p, n) in enumerate(zip(prefix_lens, tree_sizes)):
        mask = None if r % causal_every == causal_every - 1 else ancestor_mask(torch.tensor([random_parents(n, g)]))[0]
        masks.append(mask)
        positions.append(p + (torch.arange(n) if mask is None else mask.sum(-1) - 1))
    cache.reserve(rids, [p + n for p, n in zip(prefix_lens, tree_sizes)])
    return ForwardBatch.build(cache, rids, prefix_lens, tree_sizes, torch.cat(positions), masks)


# --- CPU: the pieces that decide what flashinfer computes ------------------------------------

@settings(max_examples=30, deadline=None)
@given(page_size=st.sampled_from([1, 3, 16]), seed=st.integers(0, 2**16), window=st.sampled_from([None, 1, 4]),
       prefix_lens=st.lists(st.integers(0, 20), min_size=1, max_size=4), data=st.data())
def test_custom_mask_is_the_torch_backends_mask(page_size, seed, window, prefix_lens, data):
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(1, HKV, D, num_pages=200, page_size=page_size)
    sizes = [data.draw(st.integers(1, 12)) for _ in prefix_lens]
    batch = tree_batch(cache, prefix_lens, sizes, g)
    oracle = TorchBackend(cache, sliding_window=window)
    oracle.plan(batch, graph={})  # a graph plan always keeps the mask tensor
    visible = oracle.mask[:, 0] == 0                                                   # [B, max_q, max_kv]
    flat, start = custom_mask(batch, window), 0
    for r, (p, n) in enumerate(zip(prefix_lens, sizes)):
        kv = p + n
        assert torch.equal(flat[start:start + n * kv].view(n, kv), visible[r, :n, :kv])
        start += n * kv
    assert start == len(flat)


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_page_table_addresses_every_visible_slot(page_size):
    g = torch.Generator().manual_seed(page_size)
    cache = PagedKVCache(1, HKV, D, num_pages=200, page_size=page_size)
    prefix_lens, sizes = [0, 5, 17, 33], [4, 1, 16, 9]
    batch = tree_batch(cache, prefix_lens, sizes, g)
    indptr, indices, last_page_len = page_table(cache, batch)
    assert indptr.dtype == indices.dtype == last_page_len.dtype == torch.int32
    assert int(indptr[-1]) == len(indices)
    for r, (p, n) in enumerate(zip(prefix_lens, sizes)):
        i = torch.arange(p + n)
        slots = indices[indptr[r] + i // page_size].long() * page_size + i % page_size
        assert torch.equal(slots, batch.kv_index[r, :p + n])
        assert int(indptr[r + 1] - indptr[r] - 1) * page_size + int(last_page_len[r]) == p + n


def test_positions_are_indices_only_for_consecutive_positions():
    cache = PagedKVCache(1, HKV, D, num_pages=64)
    cache.reserve([0, 1], [7, 6])
    causal = ForwardBatch.build(cache, [0, 1], [4, 3], [3, 3], torch.tensor([4, 5, 6, 3, 4, 5]))
    assert positions_are_indices(causal)
    tree = ForwardBatch.build(cache, [0, 1], [4, 3], [3, 3], torch.tensor([4, 5, 6, 3, 4, 4]))
    assert not positions_are_indices(tree)


@pytest.mark.parametrize("dtype, head_dim, message", [
    (torch.float32, 128, "float32"), (torch.bfloat16, 16, "head_dim 16"), (torch.bfloat16, 128, "CUDA")])
def test_rejects_caches_flashinfer_cannot_serve(dtype, head_dim, message):
    cache = PagedKVCache(1, HKV, head_dim, num_pages=4, dtype=dtype)
    assert not flashinfer_supports(cache)
    with pytest.raises(ValueError, match=message):
        FlashinferBackend(cache)


# --- CUDA: outputs against TorchBackend --------------------------------------------------------

# bfloat16 only: every dtype / window combination is a separate JIT build (minutes on first use)
DTYPE, TOL = torch.bfloat16, dict(atol=3e-2, rtol=3e-2)
GPU_HKV, GPU_D, GROUP, LAYERS = 2, 128, 4, 2  # head_dim 128 and GQA group 4, as in Llama-3.1-8B


def make(page_size, window=None):
    cache = PagedKVCache(LAYERS, GPU_HKV, GPU_D, num_pages=4096 // page_size, page_size=page_size,
                         dtype=DTYPE, device="cuda")
    return cache, TorchBackend(cache, window), FlashinferBackend(cache, window)


def check_forward(cache, batch, oracle, backend, g):
    """Run every layer of ``batch`` through both backends with the same q/k/v (both write the
    same K/V into the shared cache) and compare; then mark the new tokens cached."""
    oracle.plan(batch)
    backend.plan(batch)
    t = len(batch.slot_mapping)
    for layer in range(LAYERS):
        q = torch.randn(t, GPU_HKV * GROUP, GPU_D, generator=g).to("cuda", DTYPE)
        k = torch.randn(t, GPU_HKV, GPU_D, generator=g).to("cuda", DTYPE)
        v = torch.randn(t, GPU_HKV, GPU_D, generator=g).to("cuda", DTYPE)
        expected = oracle.forward(layer, q, k, v)
        torch.testing.assert_close(backend.forward(layer, q, k, v), expected, **TOL)
    for r, p, n in zip(batch.request_ids, batch.prefix_lens, batch.qo_lens):
        cache.kv_lens[r] = p + n


def extend(cache, oracle, backend, lens, g):
    """A causal extend of ``lens[r]`` tokens per request at consecutive positions."""
    rids = list(range(len(lens)))
    prefix = [cache.kv_lens.get(r, 0) for r in rids]
    cache.reserve(rids, [p + n for p, n in zip(prefix, lens)])
    positions = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix, lens)])
    check_forward(cache, ForwardBatch.build(cache, rids, prefix, lens, positions), oracle, backend, g)


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("page_size", [1, 16])
def test_prefill_extend_and_decode_match_torch(page_size):
    g = torch.Generator().manual_seed(page_size)
    cache, oracle, backend = make(page_size)
    for lens in ([5, 17, 33], [7, 1, 20]):  # batched prefill, then a chunked extend over the prefixes
        extend(cache, oracle, backend, lens, g)
        assert backend.wrapper is backend.prefill
    for _ in range(3):
        extend(cache, oracle, backend, [1, 1, 1], g)
        assert backend.wrapper is backend.decode


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("seed", [0, 1])
def test_tree_verification_matches_torch(page_size, seed):
    g = torch.Generator().manual_seed(seed)
    cache, oracle, backend = make(page_size)
    prefix_lens = [int(n) for n in torch.randint(1, 60, (4,), generator=g)]
    extend(cache, oracle, backend, prefix_lens, g)
    sizes = [int(n) for n in torch.randint(1, 65, (4,), generator=g)]
    batch = tree_batch(cache, prefix_lens, sizes, g)  # request 2 is a causal extend in the same batch
    check_forward(cache, batch, oracle, backend, g)
    assert backend.wrapper is backend.prefill

    # a drafter's next tree level: [q, m > q] masks that also cover the previous level's nodes
    rids, levels = [0, 1], [3, 5]
    prefix = [cache.kv_lens[r] for r in rids]
    masks = [torch.rand(n, sizes[r] + n, generator=g) < 0.5 for r, n in zip(rids, levels)]
    for m in masks:
        m[:, -m.shape[0]:] |= torch.eye(m.shape[0], dtype=torch.bool)  # a node sees itself
    cache.reserve(rids, [p + n for p, n in zip(prefix, levels)])
    positions = torch.cat([torch.full((n,), p) for p, n in zip(prefix_lens, levels)])
    check_forward(cache, ForwardBatch.build(cache, rids, prefix, levels, positions, masks), oracle, backend, g)


@pytest.mark.gpu
@needs_flashinfer
def test_sliding_window_matches_torch():
    g = torch.Generator().manual_seed(0)
    cache, oracle, backend = make(page_size=16, window=8)
    extend(cache, oracle, backend, [40, 25], g)                 # window_left on the prefill wrapper
    assert backend.wrapper is backend.prefill
    extend(cache, oracle, backend, [1, 1], g)                   # window_left on the decode wrapper
    assert backend.wrapper is backend.decode
    check_forward(cache, tree_batch(cache, [41, 26], [12, 9], g), oracle, backend, g)  # the window in the mask


@pytest.mark.gpu
@needs_flashinfer
def test_float32_cache_is_rejected_on_cuda():
    cache = PagedKVCache(1, GPU_HKV, GPU_D, num_pages=4, dtype=torch.float32, device="cuda")
    with pytest.raises(ValueError, match="torch"):
        FlashinferBackend(cache)
