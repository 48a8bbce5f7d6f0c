"""flashinfer attention backend (CUDA): paged decode, causal prefill/extend and tree verification.

Same contract and semantics as ``TorchBackend`` (see attention.py); written against
flashinfer-python 0.7.2.post1, whose installed source gives the calls used here:

- ``BatchDecodeWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout="NHD", backend="fa2")``,
  ``.plan(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
  window_left=-1, q_data_type=..., kv_data_type=...)``, ``.run(q, (k_cache, v_cache))``;
- ``BatchPrefillWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout="NHD", backend="fa2")``,
  ``.plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
  num_kv_heads, head_dim_qk, page_size, custom_mask=None, causal=False, window_left=-1,
  q_data_type=..., kv_data_type=...)``, ``.run(q, (k_cache, v_cache))``.

The prefill wrapper is pinned to fa2: custom masks run on fa2 only, and ``backend="auto"`` freezes
its first pick, so a causal first plan (fa3 on Hopper) would break a later tree mask. Custom
masks go to ``plan`` as a flat bool tensor (plan packs it; ``packed_custom_mask`` alone is
unreliable for batch > 1). flashinfer's kernels exist for fp16 / bf16 and head_dim 64, 128, 256,
512 only; ``flashinfer_supports`` says whether a cache qualifies.
"""

from __future__ import annotations

import functools
from itertools import chain
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from specflow.runtime.kv_cache import PagedKVCache

if TYPE_CHECKING:
    from specflow.runtime.attention import ForwardBatch

WORKSPACE_BYTES = 128 * 1024 * 1024  # flashinfer's recommended split-k scratch size
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)  # no float32 kernel instantiations
SUPPORTED_HEAD_DIMS = (64, 128, 256, 512)  # DISPATCH_HEAD_DIM in include/flashinfer/utils.cuh


@functools.cache
def flashinfer_available() -> bool:
    """True when CUDA is present and ``import flashinfer`` works."""
    if not torch.cuda.is_available():
        return False
    try:
        import flashinfer  # noqa: F401
    except (ImportError, OSError):  # not installed, or its native deps (apache-tvm-ffi) fail to load
        return False
    return True


def flashinfer_supports(cache: PagedKVCache) -> bool:
    """Whether ``FlashinferBackend`` can serve ``cache`` (CUDA, fp16/bf16, a supported head_dim)."""
    return _unsupported(cache) is None and flashinfer_available()


def _unsupported(cache: PagedKVCache) -> str | None:
    if cache.k.dtype not in SUPPORTED_DTYPES:
        return f"flashinfer has no {cache.k.dtype} kernels (float16 / bfloat16 only)"
    if cache.k.shape[-1] not in SUPPORTED_HEAD_DIMS:
        return f"flashinfer has no kernels for head_dim {cache.k.shape[-1]} (one of {SUPPORTED_HEAD_DIMS})"
    if not cache.k.is_cuda:
        return f"the KV cache is on {cache.k.device}, flashinfer needs CUDA"
    return None


def page_table(cache: PagedKVCache, batch: ForwardBatch) -> tuple[Tensor, Tensor, Tensor]:
    """flashinfer's CSR page table of the visible tokens (prefix + new) of every request:
    ``indptr`` [B + 1], ``indices`` [indptr[-1]] page ids, ``last_page_len`` [B]; int32, CPU."""
    ps = cache.page_size
    kv_lens = np.add(batch.prefix_lens, batch.qo_lens)                                 # [B]
    num_pages = -(-kv_lens // ps)                                                      # [B]
    pages = chain.from_iterable(cache.block_tables[r][:n] for r, n in zip(batch.request_ids, num_pages.tolist()))
    indices = np.fromiter(pages, dtype=np.int32, count=int(num_pages.sum()))
    indptr = np.concatenate([[0], np.cumsum(num_pages)]).astype(np.int32)
    last_page_len = (kv_lens - (num_pages - 1) * ps).astype(np.int32)
    return torch.from_numpy(indptr), torch.from_numpy(indices), torch.from_numpy(last_page_len)


def positions_are_indices(batch: ForwardBatch) -> bool:
    """Whether every new token's position is its logical index (prefix_len + i): then a
    sliding window over indices (flashinfer's ``window_left``) equals one over positions."""
    index = np.concatenate([np.arange(p, p + n) for p, n in zip(batch.prefix_lens, batch.qo_lens)])  # [T]
    return np.array_equal(batch.positions.cpu().numpy(), index)


def custom_mask(batch: ForwardBatch, sliding_window: int | None = None) -> Tensor:
    """Flattened bool mask, length sum(qo_len * kv_len), request-major, row-major per request.

    Request r's new token i sees logical index j < kv_len when j <= prefix_len + i (the prefix
    and causal new tokens); a tree mask ``[q, m]`` replaces the last m columns; a sliding window
    keeps keys with ``query_pos - key_pos < window``, where committed tokens sit at their index
    and new tokens at their (tree) positions. This is TorchBackend's mask, unpadded.
    """
    positions = batch.positions.cpu().numpy()
    sizes = [n * (p + n) for p, n in zip(batch.prefix_lens, batch.qo_lens)]
    flat = np.ones(sum(sizes), dtype=bool)  # prefix columns stay True unless the window drops them
    offset = start = 0
    for p, n, own, size in zip(batch.prefix_lens, batch.qo_lens, batch.tree_masks, sizes):
        mask = flat[offset:offset + size].reshape(n, p + n)                             # [n, kv] view
        m = n if own is None else own.shape[1]
        mask[:, p + n - m:] = np.tri(n, dtype=bool) if own is None else own.cpu().numpy()
        if sliding_window is not None:
            query_pos = positions[start:start + n]                                      # [n]
            mask[:, p:] &= (query_pos[:, None] - query_pos[None]) < sliding_window
            # prefix key j is in reach of query i when j > query_pos[i] - window
            lo, hi = (min(p, max(0, int(f(query_pos)) - sliding_window + 1)) for f in (np.min, np.max))
            mask[:, :lo] = False                                                        # out of every query's reach
            mask[:, lo:hi] &= np.arange(lo, hi)[None] > query_pos[:, None] - sliding_window
        offset += size
        start += n
    return torch.from_numpy(flat)


class FlashinferBackend:
    """flashinfer attention over the paged cache (CUDA, fp16/bf16).

    Pure decode batches (every qo_len 1, no tree mask) run the decode wrapper; prefill / extend
    runs the prefill wrapper with a causal mask; tree verification (or a sliding window over
    positions that are not token indices) runs it with a custom mask. The wrapper is planned at
    the first layer's ``forward`` of each batch, because the query head count arrives with q.
    """

    supports_graphs = False  # graph-mode wrappers (use_cuda_graph=True) are not wired yet

    def __init__(self, cache: PagedKVCache, sliding_window: int | None = None):
        if (reason := _unsupported(cache)) is not None:
            raise ValueError(f"FlashinferBackend: {reason}; use backend 'torch' instead")
        import flashinfer

        self.cache = cache
        self.sliding_window = sliding_window
        # one split-k scratch buffer shared by both wrappers: a forward runs only one of them
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=cache.k.device)
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa2")
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa2")
        self.wrapper = None
        self.plan_args: dict | None = None

    def plan(self, batch: ForwardBatch, graph: dict | None = None) -> None:
        device, dtype = self.cache.k.device, self.cache.k.dtype
        indptr, indices, last_page_len = page_table(self.cache, batch)
        trees = any(m is not None for m in batch.tree_masks)
        window_on_positions = self.sliding_window is not None and not positions_are_indices(batch)
        mask = None
        if trees or window_on_positions:  # the window goes into the mask itself
            mask = custom_mask(batch, self.sliding_window).to(device)
        window_left = -1 if self.sliding_window is None or mask is not None else self.sliding_window - 1
        args = dict(num_kv_heads=self.cache.k.shape[2], page_size=self.cache.page_size,
                    window_left=window_left, q_data_type=dtype, kv_data_type=dtype)
        if mask is None and all(q == 1 for q in batch.qo_lens):
            self.wrapper = self.decode
            self.plan_args = dict(indptr=indptr, indices=indices, last_page_len=last_page_len,
                                  head_dim=self.cache.k.shape[3], **args)
        else:
            self.wrapper = self.prefill
            qo_indptr = torch.from_numpy(np.cumsum([0, *batch.qo_lens], dtype=np.int32))  # [B + 1]
            self.plan_args = dict(qo_indptr=qo_indptr, paged_kv_indptr=indptr, paged_kv_indices=indices,
                                  paged_kv_last_page_len=last_page_len, head_dim_qk=self.cache.k.shape[3],
                                  custom_mask=mask, causal=mask is None, **args)
        self.slot_mapping = batch.slot_mapping.to(device)                              # [T]

    def forward(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]; writes k/v into the cache first."""
        k_pool, v_pool = self.cache.k[layer], self.cache.v[layer]
        k_pool.index_copy_(0, self.slot_mapping, k.to(k_pool.dtype))
        v_pool.index_copy_(0, self.slot_mapping, v.to(v_pool.dtype))
        if self.plan_args is not None:  # first layer of this batch
            self.wrapper.plan(num_qo_heads=q.shape[1], **self.plan_args)
            self.plan_args = None
        pages = (-1, self.cache.page_size, *k_pool.shape[1:])                          # [pages, page_size, Hkv, D]
        out = self.wrapper.run(q.to(k_pool.dtype).contiguous(), (k_pool.view(pages), v_pool.view(pages)))
        return out.to(q.dtype)                                                         # [T, Hq, D]
