"""FlashinferBackend against the torch oracle: its mask and page table on CPU; its planning, its
CUDA-graph buffers and the padded graph path on CPU through a fake flashinfer module (wrappers
with flashinfer's signatures and buffer semantics, attention computed in torch); its outputs on CUDA."""

import ast
import importlib.util
import inspect
import os
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from hypothesis import given, settings
from hypothesis import strategies as st

from specflow.engine import SpecEngine
from specflow.models import load_model
from specflow.runtime import flashinfer_backend
from specflow.runtime import attention
from specflow.runtime.attention import ForwardBatch, TorchBackend
from specflow.runtime.beam import Beam
from specflow.runtime.cuda_graph import PAD_REQUEST, GraphRunner
from specflow.runtime.flashinfer_backend import FlashinferBackend, flashinfer_available, flashinfer_supports
from specflow.runtime.flashinfer_inputs import custom_mask, packbits, page_table, positions_are_indices
from specflow.runtime.kv_cache import PagedKVCache
from specflow.runtime.model_runner import ModelRunner
from specflow.sampling import SamplingParams
from specflow.tree import ancestor_mask
from tests.runtime.fake_flashinfer import FakeDecodeWrapper, FakePrefillWrapper
from tests.runtime.test_attention import HKV, D, random_parents
from tests.runtime.test_cuda_graph import cached_kv, random_tree

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
    """Both ways tree masks reach the mask: stacked where they lie (one shape, as a target's
    verification: the 3rd request, causal, may send more tokens) or laid out on the host."""
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(1, HKV, D, num_pages=200, page_size=page_size)
    sizes = [data.draw(st.integers(1, 12)) for _ in prefix_lens]
    if data.draw(st.booleans(), "one tree size"):
        sizes = [sizes[0] if r % 3 != 2 else n for r, n in enumerate(sizes)]
    batch = tree_batch(cache, prefix_lens, sizes, g)
    oracle = TorchBackend(cache, sliding_window=window)
    oracle.plan(batch, graph={})  # a graph plan always keeps the mask tensor
    visible = oracle.mask[:, 0] == 0                                                   # [B, max_q, max_kv]
    flat, start = custom_mask(batch, window), 0
    aligned, packed, at = custom_mask(batch, window, align=8), [], 0  # what a graph's mask buffer gets
    for r, (p, n) in enumerate(zip(prefix_lens, sizes)):
        kv = p + n
        assert torch.equal(flat[start:start + n * kv].view(n, kv), visible[r, :n, :kv])
        span = -(-n * kv // 8) * 8
        assert torch.equal(aligned[at:at + span], F.pad(flat[start:start + n * kv], (0, span - n * kv)))
        packed.append(np.packbits(flat[start:start + n * kv].numpy(), bitorder="little"))  # segment_packbits
        start, at = start + n * kv, at + span
    assert start == len(flat) and at == len(aligned)
    assert np.array_equal(packbits(aligned).numpy(), np.concatenate(packed))


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


@pytest.fixture
def fake_flashinfer(monkeypatch):
    """FlashinferBackend over the fake module, on CPU float32 caches."""
    fake = types.ModuleType("flashinfer")
    fake.BatchDecodeWithPagedKVCacheWrapper = FakeDecodeWrapper
    fake.BatchPrefillWithPagedKVCacheWrapper = FakePrefillWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setattr(flashinfer_backend, "_unsupported", lambda cache: None)
    monkeypatch.setattr(flashinfer_backend, "WORKSPACE_BYTES", 1024)
    return fake


def test_auto_picks_flashinfer_when_it_can_serve_the_cache(fake_flashinfer, monkeypatch):
    monkeypatch.setattr(attention, "flashinfer_supports", lambda cache: True)
    cache = PagedKVCache(1, HKV, D, num_pages=8)
    backend = attention.BACKENDS["auto"](cache, None, HKV * 4)  # auto hands num_qo_heads on
    assert isinstance(backend, FlashinferBackend) and backend.num_qo_heads == HKV * 4 and backend.supports_graphs


@pytest.mark.parametrize("group,decode", [(1, True), (4, True), (7, False), (5, False), (16, True), (None, False)])
def test_group_sizes_without_a_decode_kernel_take_prefill(fake_flashinfer, group, decode):
    """(None: a lazily planned backend, which does not know the group size yet.)"""
    cache = PagedKVCache(1, HKV, D, num_pages=64)
    backend = FlashinferBackend(cache, num_qo_heads=None if group is None else HKV * group)
    cache.reserve([0, 1], [5, 3])
    batch = ForwardBatch.build(cache, [0, 1], [4, 2], [1, 1], torch.tensor([4, 2]))
    assert backend.uses_decode_kernel(batch) is decode


def test_fake_wrappers_take_flashinfers_parameters():
    """Every parameter the fakes accept is one of the installed flashinfer's (read from its source,
    without importing it); skipped where flashinfer is not installed."""
    spec = importlib.util.find_spec("flashinfer")
    if spec is None or spec.origin is None:
        pytest.skip("flashinfer is not installed")
    for fake, file, name in ((FakeDecodeWrapper, "decode.py", "BatchDecodeWithPagedKVCacheWrapper"),
                             (FakePrefillWrapper, "prefill.py", "BatchPrefillWithPagedKVCacheWrapper")):
        tree = ast.parse((Path(spec.origin).parent / file).read_text())
        cls = next(c for c in tree.body if isinstance(c, ast.ClassDef) and c.name == name)
        real = {}
        for f in cls.body:
            if isinstance(f, ast.FunctionDef):
                real.setdefault(f.name, set()).update(a.arg for a in f.args.args + f.args.kwonlyargs)
        real["plan"] |= real.get("_plan_impl", set())  # the decode wrapper's plan forwards **kwargs there
        for method in ("__init__", "plan", "run"):
            assert set(inspect.signature(getattr(fake, method)).parameters) <= real[method], (name, method)


# --- outputs against TorchBackend: on CPU through the fake, on CUDA through flashinfer -------------

# bfloat16 only on CUDA: every dtype / window combination is a separate JIT build (minutes on first use)
GPU_HKV, GPU_D, GROUP, LAYERS = 2, 128, 4, 2  # head_dim 128 and GQA group 4, as in Llama-3.1-8B
GPU_HQ = GPU_HKV * GROUP


@pytest.fixture(params=["fake", pytest.param("cuda", marks=[pytest.mark.gpu, needs_flashinfer])])
def make(request):
    """``make(page_size, window, num_qo_heads)`` -> (cache, TorchBackend, FlashinferBackend): float32
    on CPU over the fake flashinfer, or bfloat16 on CUDA over the real one."""
    device, dtype = ("cuda", torch.bfloat16) if request.param == "cuda" else ("cpu", torch.float32)
    if request.param == "fake":
        request.getfixturevalue("fake_flashinfer")

    def build(page_size, window=None, num_qo_heads=GPU_HQ):
        cache = PagedKVCache(LAYERS, GPU_HKV, GPU_D, num_pages=4096 // page_size, page_size=page_size,
                             dtype=dtype, device=device)
        return cache, TorchBackend(cache, window), FlashinferBackend(cache, window, num_qo_heads=num_qo_heads)
    return build


def check_forward(cache, batch, oracle, backend, g, plan=True):
    """Run every layer of ``batch`` through both backends with the same q/k/v (both write the
    same K/V into the shared cache) and compare; then mark the new tokens cached."""
    device, dtype = cache.k.device, cache.k.dtype
    tol = dict(atol=3e-2, rtol=3e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    oracle.plan(batch)
    if plan:
        backend.plan(batch)
    t = len(batch.slot_mapping)
    for layer in range(LAYERS):
        q = torch.randn(t, GPU_HQ, GPU_D, generator=g).to(device, dtype)
        k = torch.randn(t, GPU_HKV, GPU_D, generator=g).to(device, dtype)
        v = torch.randn(t, GPU_HKV, GPU_D, generator=g).to(device, dtype)
        expected = oracle.forward(layer, q, k, v)
        torch.testing.assert_close(backend.forward(layer, q, k, v)[:t], expected, **tol)
    for r, p, n in zip(batch.request_ids, batch.prefix_lens, batch.qo_lens):
        cache.kv_lens[r] = p + n


def extend(cache, oracle, backend, lens, g):
    """A causal extend of ``lens[r]`` tokens per request at consecutive positions."""
    rids = list(range(len(lens)))
    prefix = [cache.kv_lens.get(r, 0) for r in rids]
    cache.reserve(rids, [p + n for p, n in zip(prefix, lens)])
    positions = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix, lens)])
    check_forward(cache, ForwardBatch.build(cache, rids, prefix, lens, positions), oracle, backend, g)


@pytest.mark.parametrize("num_qo_heads", [None, GPU_HQ], ids=["lazy-plan", "plan"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_prefill_extend_and_decode_match_torch(make, page_size, num_qo_heads):
    g = torch.Generator().manual_seed(page_size)
    cache, oracle, backend = make(page_size, num_qo_heads=num_qo_heads)
    assert backend.supports_graphs == (num_qo_heads is not None)
    for lens in ([5, 17, 33], [7, 1, 20]):  # batched prefill, then a chunked extend over the prefixes
        extend(cache, oracle, backend, lens, g)
        assert backend.wrapper is backend.prefill
    for _ in range(3):  # lazily planned, the group size is unknown: the prefill kernel serves any
        extend(cache, oracle, backend, [1, 1, 1], g)
        assert backend.wrapper is (backend.decode if num_qo_heads else backend.prefill)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("seed", [0, 1])
def test_tree_verification_matches_torch(make, page_size, seed):
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


def window_kernels_missing() -> bool:
    """Under FLASHINFER_DISABLE_JIT (bench/gpu/session.sh) flashinfer loads prebuilt kernels only,
    and bench/gpu/aot_flashinfer.py builds the sliding-window ones with --sliding-window alone."""
    from flashinfer.jit import env

    return bool(os.environ.get("FLASHINFER_DISABLE_JIT")) and not any(env.FLASHINFER_AOT_DIR.glob("*use_swa_True*"))


def test_sliding_window_matches_torch(make, request):
    if request.node.callspec.params["make"] == "cuda" and window_kernels_missing():
        pytest.skip("flashinfer's sliding-window kernels are not prebuilt (aot_flashinfer.py --sliding-window) "
                    "and FLASHINFER_DISABLE_JIT is set")
    g = torch.Generator().manual_seed(0)
    cache, oracle, backend = make(page_size=16, window=8)
    extend(cache, oracle, backend, [40, 25], g)                 # window_left on the prefill wrapper
    assert backend.wrapper is backend.prefill
    extend(cache, oracle, backend, [1, 1], g)                   # window_left on the decode wrapper
    assert backend.wrapper is backend.decode
    check_forward(cache, tree_batch(cache, [41, 26], [12, 9], g), oracle, backend, g)  # the window in the mask


# --- CUDA-graph planning: one wrapper per graph over fixed buffers, rewritten in place ----------

def padded_batch(cache, rids, n, size, g, masks=None, width=128):
    """What GraphRunner plans: ``n`` new tokens for each of ``rids`` (random trees unless ``masks``
    is given), padded with PAD_REQUEST rows to ``size`` requests and the KV index to ``width``."""
    prefix = [cache.kv_lens[r] for r in rids]
    cache.reserve(rids, [p + n for p in prefix])
    if masks is None:
        masks = [random_tree(n, g)[0] if n > 1 else None for _ in rids]
    positions = [p + (torch.arange(n) if m is None else m[:, -n:].sum(-1) - 1) for p, m in zip(prefix, masks)]
    pad = size - len(rids)
    return ForwardBatch.build(cache, rids + [PAD_REQUEST] * pad, prefix + [0] * pad, [n] * size,
                              torch.cat(positions + [torch.zeros(pad * n, dtype=torch.long)]),
                              masks + [None] * pad, kv_width=width)


def graph_setup(make, page_size, n=4):
    cache, oracle, backend = make(page_size)
    g = torch.Generator().manual_seed(page_size)
    extend(cache, oracle, backend, [5, 17, 33, 9, 21], g)
    cache.reserve([PAD_REQUEST], [n])
    return cache, oracle, backend, g


def check_graph_forward(cache, batch, oracle, backend, state, g):
    """Plan ``batch`` into ``state`` and compare the real rows with the torch oracle; the padding
    rows' K/V goes to the padding page only."""
    real = [i for i, r in enumerate(batch.request_ids) if r != PAD_REQUEST]
    t = len(real) * batch.qo_lens[0]
    unpadded = ForwardBatch.build(cache, [batch.request_ids[i] for i in real], [batch.prefix_lens[i] for i in real],
                                  [batch.qo_lens[i] for i in real], batch.positions[:t],
                                  [batch.tree_masks[i] for i in real])
    backend.plan(batch, graph=state)
    assert backend.plan_args is None, "a graph is planned in plan(), never in forward"
    check_forward(cache, unpadded, oracle, BatchPadding(backend, len(batch.slot_mapping)), g, plan=False)


class BatchPadding:
    """Feeds a planned padded backend the real rows' q/k/v, zero-padded like GraphRunner's inputs."""

    def __init__(self, backend, num_tokens):
        self.backend, self.num_tokens = backend, num_tokens

    def forward(self, layer, q, k, v):
        pad = self.num_tokens - len(q)
        return self.backend.forward(layer, *(torch.cat([x, x.new_zeros(pad, *x.shape[1:])]) for x in (q, k, v)))


def graph_tables(state) -> tuple[Tensor, Tensor, Tensor]:
    """A graph's page-table buffers (indptr, indices, last_page_len), by flashinfer's names."""
    names = ("paged_kv_indptr_buffer", "paged_kv_indices_buffer", "paged_kv_last_page_len_buffer") if state["decode"] \
        else ("paged_kv_indptr_buf", "paged_kv_indices_buf", "paged_kv_last_page_len_buf")
    return tuple(state["buffers"][k].cpu() for k in names)


@pytest.mark.parametrize("page_size", [1, 16])
def test_graph_plans_write_into_the_graphs_buffers(make, page_size):
    cache, oracle, backend, g = graph_setup(make, page_size)
    pages = -(-128 // page_size)
    for n, size, first, second in ((4, 4, [0, 2, 3], [1, 3, 4]), (1, 2, [0], [2, 4])):
        state = {}
        check_graph_forward(cache, padded_batch(cache, first, n, size, g), oracle, backend, state, g)
        wrapper, buffers, slot_mapping = state["wrapper"], dict(state["buffers"]), state["slot_mapping"]
        ptrs = {name: b.data_ptr() for name, b in buffers.items()}
        assert wrapper.is_cuda_graph_enabled and backend.wrapper is wrapper
        assert type(wrapper) is type(backend.decode if n == 1 else backend.prefill)
        sizes = {name: len(b) for name, b in buffers.items()}
        if n == 1:
            assert sizes == dict(paged_kv_indptr_buffer=size + 1, paged_kv_indices_buffer=size * pages,
                                 paged_kv_last_page_len_buffer=size)
        else:  # the packed mask: ceil(N * W / 8) bytes per request
            assert sizes == dict(qo_indptr_buf=size + 1, paged_kv_indptr_buf=size + 1, mask_indptr_buf=size + 1,
                                 paged_kv_indices_buf=size * pages, paged_kv_last_page_len_buf=size,
                                 custom_mask_buf=size * -(-n * 128 // 8))

        batch = padded_batch(cache, second, n, size, g)  # the same graph, another batch
        check_graph_forward(cache, batch, oracle, backend, state, g)
        assert state["wrapper"] is wrapper and state["slot_mapping"] is slot_mapping
        assert all(state["buffers"][k] is b and b.data_ptr() == ptrs[k] for k, b in buffers.items())
        indptr, indices, last_page_len = page_table(cache, batch)
        kv_indptr, kv_indices, kv_last_page_len = graph_tables(state)
        assert torch.equal(kv_indptr, indptr) and torch.equal(kv_last_page_len, last_page_len)
        assert torch.equal(kv_indices[:len(indices)], indices)
        assert torch.equal(slot_mapping.cpu(), batch.slot_mapping) and slot_mapping.device == cache.k.device
        if n > 1:  # a causal batch: a graph's prefill wrapper still runs masked, so it still gets a mask
            causal = padded_batch(cache, first, n, size, g, masks=[None] * len(first))
            check_graph_forward(cache, causal, oracle, backend, state, g)
        if isinstance(wrapper, (FakeDecodeWrapper, FakePrefillWrapper)):
            assert wrapper.plans == 2 + (n > 1)


def add_scratch(cache, rids, n=2):
    """Pretend ``n`` tree nodes of each request were expanded before (scratch after the prefix)."""
    cache.reserve(rids, [cache.kv_lens[r] + n for r in rids])
    for r in rids:
        cache.kv_lens[r] += n


@pytest.mark.parametrize("page_size", [1, 16])
def test_graph_wrapper_kind_is_fixed_by_the_first_plan(make, page_size):
    cache, oracle, backend, g = graph_setup(make, page_size)
    hiding = [torch.tensor([[True, False, True]]), torch.tensor([[False, True, True]])]  # [1, 3]: a sibling hidden
    chain = [torch.ones(1, 3, dtype=torch.bool)] * 2                                      # [1, 3]: a chain's next node

    masked = {}  # a one-token tree level first: a masked prefill graph serves plain decode batches too
    add_scratch(cache, [0, 1])
    check_graph_forward(cache, padded_batch(cache, [0, 1], 1, 2, g, masks=hiding), oracle, backend, masked, g)
    check_graph_forward(cache, padded_batch(cache, [2, 3], 1, 2, g), oracle, backend, masked, g)
    assert not masked["decode"] and backend.wrapper is masked["wrapper"]

    decode = {}  # a decode graph takes a chain's all-visible masks, and refuses masks that hide a key
    check_graph_forward(cache, padded_batch(cache, [2, 3], 1, 2, g), oracle, backend, decode, g)
    add_scratch(cache, [0, 1])
    check_graph_forward(cache, padded_batch(cache, [0, 1], 1, 2, g, masks=chain), oracle, backend, decode, g)
    assert decode["decode"] and backend.wrapper is decode["wrapper"]
    add_scratch(cache, [0, 1])
    with pytest.raises(ValueError, match="decode kernel"):
        backend.plan(padded_batch(cache, [0, 1], 1, 2, g, masks=hiding), graph=decode)


def test_graphs_need_the_head_count(fake_flashinfer):
    cache = PagedKVCache(1, HKV, D, num_pages=64)
    backend = FlashinferBackend(cache)
    assert not backend.supports_graphs
    cache.reserve([0], [1])
    with pytest.raises(ValueError, match="num_qo_heads"):
        backend.plan(ForwardBatch.build(cache, [0], [0], [1], torch.zeros(1, dtype=torch.long)), graph={})


# (request ids, tokens per request): padded sizes, two KV widths (request 5 is past 128 tokens),
# and graphs (B, N, W) = (4, 1, 128) and (4, 4, 128) replanned with another batch
GRAPH_STEPS = [([0, 1, 2], 1), ([1, 3, 4], 1), ([0, 2, 3], 4), ([1, 3, 4], 4), ([0, 5], 1),
               ([0, 1, 2, 3, 5], 4), ([5], 4), ([0, 1, 2, 3, 4], 4), ([1, 2, 3, 5], 1)]
# (batch size, tokens per request) -> the KV widths its graphs were planned for, in order: one graph
# per key serves every narrower batch, and a wider one replaces it
GRAPH_WIDTHS = {(4, 1): [128, 256], (4, 4): [128], (2, 1): [256], (8, 4): [256], (1, 4): [256]}


def graph_runners(model, page_size):
    """A plain TorchBackend runner and a FlashinferBackend runner on the padded graph path."""
    plain = ModelRunner(model, num_pages=2048 // page_size, page_size=page_size)
    graphed = ModelRunner(model, num_pages=2048 // page_size, page_size=page_size, backend="flashinfer")
    assert graphed.attn.num_qo_heads == model.config.num_attention_heads
    graphed.enable_graphs(max_batch_size=8, max_tokens_per_request=4)
    return plain, graphed


def run_graph_steps(plain, graphed, g, tol) -> dict:
    """Prefill six requests on both runners, then GRAPH_STEPS with random trees; outputs and every
    request's K/V (after committing a random path) must agree. Returns the wrappers of each
    (batch size, tokens per request), in order."""
    vocab = plain.model.config.vocab_size
    rids = list(range(6))
    prompts = [torch.randint(1, vocab, (n,), generator=g) for n in (5, 17, 33, 9, 21, 140)]
    for runner in (plain, graphed):
        runner.extend(rids, prompts, logits="none")  # an eager flashinfer prefill
    wrappers = {}
    for batch, n in GRAPH_STEPS:
        trees = [random_tree(n, g) for _ in batch]
        tokens = [torch.randint(1, vocab, (n,), generator=g) for _ in batch]
        positions = [plain.kv_len(r) + depth for r, (_, depth) in zip(batch, trees)]
        masks = [mask if n > 1 else None for mask, _ in trees]
        outs = [runner.extend(batch, tokens, positions=positions, tree_masks=masks) for runner in (plain, graphed)]
        torch.testing.assert_close(outs[1].hidden, outs[0].hidden, **tol)
        torch.testing.assert_close(outs[1].logits, outs[0].logits, **tol)
        for r, (mask, _) in zip(batch, trees):  # accept a random root-to-node path
            keep = mask[int(torch.randint(0, n, (), generator=g))].nonzero()[:, 0].tolist()
            base = plain.kv_len(r) - n
            for runner in (plain, graphed):
                runner.commit([r], [base], [keep])
        for r in rids:
            for ours, theirs in zip(cached_kv(graphed, r), cached_kv(plain, r)):
                torch.testing.assert_close(ours, theirs, **tol)
        for key, graph in graphed.graphs.graphs.items():  # a graph's wrapper is its own until a wider batch
            seen = wrappers.setdefault(key[:2], [])
            if not seen or seen[-1] is not graph.attn_state["wrapper"]:
                seen.append(graph.attn_state["wrapper"])
        assert len(graphed.graphs.graphs) == len(wrappers), "one graph per (batch size, tokens per request)"
    states = {key[:2]: graph.attn_state for key, graph in graphed.graphs.graphs.items()}
    assert {key: len(ws) for key, ws in wrappers.items()} == {key: len(w) for key, w in GRAPH_WIDTHS.items()}
    assert all(states[key]["shape"][2] == widths[-1] for key, widths in GRAPH_WIDTHS.items())
    assert all(w.is_cuda_graph_enabled and type(w) is type(graphed.attn.decode if n == 1 else graphed.attn.prefill)
               for (_, n), ws in wrappers.items() for w in ws)
    return wrappers


@pytest.mark.parametrize("page_size", [1, 16])
def test_graph_runner_with_flashinfer_matches_torch(fake_flashinfer, tiny_target, page_size):
    """ModelRunner's padded static path (GraphRunner, eager on CPU) over FlashinferBackend equals
    plain TorchBackend forwards."""
    plain, graphed = graph_runners(load_model(tiny_target, device="cpu"), page_size)
    wrappers = run_graph_steps(plain, graphed, torch.Generator().manual_seed(page_size), dict(atol=1e-4, rtol=1e-4))
    assert wrappers[(4, 1)][0].plans == wrappers[(4, 4)][0].plans == 2  # (4, 1): then replaced by a wider graph


@pytest.mark.parametrize("drafter", ["eagle", "draft", "medusa"])
def test_engine_over_flashinfer_graphs_matches_torch(fake_flashinfer, monkeypatch, drafter):
    """The whole engine over the fake flashinfer with CUDA graphs on (eager on CPU), drafters
    included: their tree levels, their catch-ups of uneven lengths, tree verification and decode
    give the torch backend's greedy output, also across graphs that a request outgrows (its
    context passes 128 tokens) and that wider ones replace."""
    zoo = "zoo/tiny-code"
    node = {"eagle": {"type": "eagle", "path": f"{zoo}/eagle"},
            "draft": {"type": "draft_model", "path": f"{zoo}/draft"},
            "medusa": {"type": "medusa", "path": f"{zoo}/medusa"}}[drafter]
    tree = {"type": "eagle2", "topk": 4, "depth": 3, "num_draft_tokens": 8}
    prompts = ["def main(", "import os\nimport sys\n", "class Tree:\n    def __init__(self",
               "for i in range(10):\n    print(i)\n" * 8]  # 112 tokens
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (20, 12, 6, 24)]
    made = []  # every graph made, replaced ones included

    def counted(new_graph):
        def call(self, *args):
            made.append(new_graph(self, *args))
            return made[-1]
        return call

    for owner in (GraphRunner, Beam):
        monkeypatch.setattr(owner, "_new_graph", counted(owner._new_graph))
    engines = [SpecEngine(f"{zoo}/target", node, tree, {"type": "greedy"}, device="cpu", dtype="float32",
                          backend=backend, cuda_graphs=graphs) for backend, graphs in (("torch", False),
                                                                                        ("flashinfer", True))]
    outs = [engine.generate(prompts, params) for engine in engines]
    assert [o.token_ids for o in outs[1]] == [o.token_ids for o in outs[0]]
    assert isinstance(engines[1].runner.attn, FlashinferBackend) and engines[1].runner.graphs.graphs
    if drafter != "medusa":
        assert isinstance(engines[1].drafter.runner.runner.attn, FlashinferBackend)
        assert engines[1].drafter.runner.runner.graphs.graphs
    if drafter == "eagle":  # EAGLE-2's levels as beam graphs, each level's decode wrapper planned before the run
        beams = engines[1].drafter.runner.runner.graphs.beams.values()
        assert beams and all(state["decode"] for beam in beams for state in beam.attn)
    runners = [engines[1].runner] + ([engines[1].drafter.runner.runner] if drafter != "medusa" else [])
    kept = sum(len(r.graphs.graphs) + len(r.graphs.beams) for r in runners)
    assert len(made) > kept, "no graph was outgrown"


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("page_size", [1, 16])
def test_captured_flashinfer_graphs_match_torch(page_size):
    """The same steps replayed from captured CUDA graphs, on the shipped target in bfloat16."""
    plain, graphed = graph_runners(load_model("zoo/tiny-code/target", device="cuda", dtype=torch.bfloat16), page_size)
    run_graph_steps(plain, graphed, torch.Generator().manual_seed(page_size), dict(atol=0.1, rtol=0.05))
    assert all(graph.graph is not None for graph in graphed.graphs.graphs.values())


@pytest.mark.gpu
@needs_flashinfer
def test_float32_cache_is_rejected_on_cuda():
    cache = PagedKVCache(1, GPU_HKV, GPU_D, num_pages=4, dtype=torch.float32, device="cuda")
    with pytest.raises(ValueError, match="torch"):
        FlashinferBackend(cache)
