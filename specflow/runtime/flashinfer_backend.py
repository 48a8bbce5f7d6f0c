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

CUDA graphs (``plan(batch, graph=state)``, see specflow.runtime.cuda_graph): ``plan`` is host work
and cannot be captured, so every graph owns a wrapper built with ``use_cuda_graph=True`` over
fixed device buffers; each later ``plan`` for that graph rewrites those buffers in place (the
wrapper's own graph-mode ``plan`` does the ``copy_``), and the replay reads them. The graph
runner pads every batch of one graph to B requests of N tokens each; its buffers are sized at
the first plan for a KV index W wide, so a request's KV length is at most W and its page count
at most ceil(W / page_size). Nothing captured depends on W (a graph-mode wrapper launches a grid
fixed by B), so one graph serves every narrower batch (``graph_fits``), and the graph runner
captures a wider one in its place when a batch outgrows it. A dummy request (padding) is an
ordinary row here: its page-table entries are its own reserved page, its mask row is causal
over its own N tokens (never empty), and its K/V goes to that page only. The buffers:

- decode (``uses_decode_kernel``): ``paged_kv_indptr_buffer`` [B + 1], ``paged_kv_indices_buffer``
  [B * ceil(W / page_size)], ``paged_kv_last_page_len_buffer`` [B] (int32);
- prefill (tree verification, multi-token expansions): ``qo_indptr_buf``, ``paged_kv_indptr_buf``,
  ``mask_indptr_buf`` [B + 1], ``paged_kv_last_page_len_buf`` [B], ``paged_kv_indices_buf``
  [B * ceil(W / page_size)] (int32), and ``custom_mask_buf`` [B * ceil(N * W / 8)] (uint8): plan
  packs request r's [N, kv_len_r] bool mask into ceil(N * kv_len_r / 8) bytes (segment_packbits,
  little bit order) and kv_len_r <= W.

A graph-mode prefill wrapper given ``custom_mask_buf`` always runs with the custom mask (its
``run`` checks only that the buffer exists), so every plan of such a graph fills the mask
buffers, causal batches and padding rows included. The backend packs the mask itself, on the
device, as ``plan`` would (``_write_mask``): ``plan``'s own packing waits for the GPU twice (a
blocking copy of its indptr, then ``.item()``), and so does its copy of host page indices into
a graph's buffer (once), so the indices go to the device first; the spec_step bench counts what
still waits. Which wrapper a graph gets is fixed at its first plan; a decode graph cannot serve
a later batch that needs a mask, so ``graph_key`` is ``uses_decode_kernel``.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from typing import TYPE_CHECKING, Hashable

import numpy as np
import torch
from torch import Tensor

from specflow.runtime.flashinfer_inputs import custom_mask, packbits, page_table, positions_are_indices
from specflow.runtime.kv_cache import PagedKVCache
from specflow.runtime.transfer import to_device

if TYPE_CHECKING:
    from specflow.runtime.attention import ForwardBatch

WORKSPACE_BYTES = 128 * 1024 * 1024  # flashinfer's recommended split-k scratch size
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)  # no float32 kernel instantiations
DECODE_GROUP_SIZES = (1, 2, 3, 4, 6, 8, 16)  # query heads per KV head of the fa2 decode kernels (batch_decode.cu)
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
    except Exception as e:  # a broken install (a slimmed wheel, a version clash) must not break the caller
        warnings.warn(f"flashinfer is installed but failed to import ({e!r}); using the torch backend")
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


class FlashinferBackend:
    """flashinfer attention over the paged cache (CUDA, fp16/bf16).

    Decode batches (``uses_decode_kernel``) run the decode wrapper; prefill / extend
    runs the prefill wrapper with a causal mask; tree verification (or a sliding window over
    positions that are not token indices) runs it with a custom mask. ``num_qo_heads`` lets
    ``plan`` plan the wrapper at once; without it the wrapper is planned at the first layer's
    ``forward`` (the head count arrives with q), every batch takes the prefill wrapper (the
    decode kernels serve only some query heads per KV head), and CUDA graphs are off, because a
    graph must be planned before its first forward is captured.
    """

    supports_graphs = True

    def __init__(self, cache: PagedKVCache, sliding_window: int | None = None,
                 num_qo_heads: int | None = None):
        if (reason := _unsupported(cache)) is not None:
            raise ValueError(f"FlashinferBackend: {reason}; use backend 'torch' instead")
        import flashinfer

        self.flashinfer = flashinfer
        self.cache = cache
        self.sliding_window = sliding_window
        self.num_qo_heads = num_qo_heads
        if num_qo_heads is None:
            self.supports_graphs = False
        # other GQA group sizes (e.g. Qwen2.5-7B's 7), or an unknown one, take the prefill kernel,
        # which has no such limit
        self.decode_ok = num_qo_heads is not None and num_qo_heads // cache.k.shape[2] in DECODE_GROUP_SIZES
        # one split-k scratch buffer shared by every wrapper, graphs' included: forwards run one at a time
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=cache.k.device)
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa2")
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa2")
        self.wrapper = None
        self.plan_args: dict | None = None
        self.planned: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # wrapper -> its last plan's event

    def graph_key(self, batch: ForwardBatch) -> Hashable:
        return self.uses_decode_kernel(batch)  # a decode graph never replays a masked batch

    def graph_fits(self, graph: dict, batch: ForwardBatch) -> bool:
        """Whether the graph's buffers hold ``batch``'s page table and masks: its KV index is no
        wider than the first batch's (the kernels are captured for a batch size, not a width)."""
        return not graph or batch.kv_index.shape[1] <= graph["shape"][2]

    def uses_decode_kernel(self, batch: ForwardBatch) -> bool:
        """Whether ``batch`` runs the decode wrapper: one token per request, no window over tree
        positions, and no tree mask that hides a key (a one-token node that sees every earlier
        node, like a chain's next node, is plain decode)."""
        return (self.decode_ok and all(q == 1 for q in batch.qo_lens) and not self._window_on_positions(batch)
                and all(m is None or bool(m.all()) for m in batch.tree_masks))

    def _window_on_positions(self, batch: ForwardBatch) -> bool:
        return self.sliding_window is not None and not positions_are_indices(batch)

    def plan(self, batch: ForwardBatch, graph: dict | None = None) -> None:
        # the window goes into the mask itself when positions are not indices
        needs_mask = any(m is not None for m in batch.tree_masks) or self._window_on_positions(batch)
        decode = self.uses_decode_kernel(batch)
        if graph is not None:
            if self.num_qo_heads is None:
                raise ValueError("FlashinferBackend: CUDA graphs need num_qo_heads at construction "
                                 "(a graph is planned before its first forward)")
            if not graph:
                graph.update(self._graph_state(batch, decode))
            self._check_graph(graph, batch, decode)
            decode = graph["decode"]
        indptr, indices, last_page_len = page_table(self.cache, batch)
        # the page indices go to the device first: flashinfer copies host ones into a graph's
        # buffer with a copy that waits for the GPU (the indptrs it reads on the host)
        indices, slot_mapping = to_device([indices, batch.slot_mapping], self.cache.k.device)  # one copy
        table = dict(indptr=indptr, indices=indices, last_page_len=last_page_len)
        if decode:
            args = self._decode_args(**table)
        elif graph is None:
            args = self._prefill_args(batch, needs_mask, custom_mask(batch, self.sliding_window, self.cache.k.device)
                                      if needs_mask else None, **table)
        else:  # a graph's wrapper always reads its mask buffers: fill them here (flashinfer's packing waits for the GPU)
            args = self._prefill_args(batch, masked=True, mask=None, **table)
            self._write_mask(graph["buffers"], batch)
        if graph is None:
            self.wrapper, self.slot_mapping = self.decode if decode else self.prefill, slot_mapping
        else:  # the replay reads the graph's tensors: write into them, never rebind
            if not decode:  # fa2 then sizes its query tiles for N rows, not for the ragged worst case
                args["uniform_q_len"] = batch.qo_lens[0]
            self.wrapper = graph["wrapper"]
            self.slot_mapping = graph["slot_mapping"].copy_(slot_mapping)               # [B * N]
        if self.num_qo_heads is None:  # planned at the first layer's forward
            self.plan_args = args
        else:
            self._plan_wrapper(self.num_qo_heads, args)
            self.plan_args = None

    def _plan_wrapper(self, num_qo_heads: int, args: dict) -> None:
        """``self.wrapper.plan``, once the GPU has taken that wrapper's previous plan: flashinfer
        writes a plan into the wrapper's pinned host buffer and queues its copy to the device
        without waiting, so planning again before that copy ran would change what the previous
        forward reads. (Host waits in every step make this wait instant; it guards a pipeline
        that has none.)"""
        done = self.planned.get(self.wrapper)
        if done is not None:
            done.synchronize()
        self.wrapper.plan(num_qo_heads=num_qo_heads, **args)
        if self.cache.k.is_cuda:
            self.planned[self.wrapper] = torch.cuda.Event()
            self.planned[self.wrapper].record()

    def use(self, graph: dict) -> None:
        self.wrapper, self.slot_mapping, self.plan_args = graph["wrapper"], graph["slot_mapping"], None

    def _common_args(self) -> dict:
        dtype = self.cache.k.dtype
        return dict(num_kv_heads=self.cache.k.shape[2], page_size=self.cache.page_size,
                    q_data_type=dtype, kv_data_type=dtype)

    def _decode_args(self, indptr: Tensor, indices: Tensor, last_page_len: Tensor) -> dict:
        window_left = -1 if self.sliding_window is None else self.sliding_window - 1
        return dict(indptr=indptr, indices=indices, last_page_len=last_page_len, head_dim=self.cache.k.shape[3],
                    window_left=window_left, **self._common_args())

    def _prefill_args(self, batch: ForwardBatch, masked: bool, mask: Tensor | None, indptr: Tensor,
                      indices: Tensor, last_page_len: Tensor) -> dict:
        """``masked``: a custom mask (``mask``, or one written into a graph's buffers) with the
        window in it; else causal with flashinfer's window."""
        qo_indptr = torch.from_numpy(np.cumsum([0, *batch.qo_lens], dtype=np.int32))    # [B + 1]
        window_left = -1 if self.sliding_window is None or masked else self.sliding_window - 1
        return dict(qo_indptr=qo_indptr, paged_kv_indptr=indptr, paged_kv_indices=indices,
                    paged_kv_last_page_len=last_page_len, head_dim_qk=self.cache.k.shape[3],
                    custom_mask=mask, causal=not masked, window_left=window_left, **self._common_args())

    def _write_mask(self, buffers: dict, batch: ForwardBatch) -> None:
        """The batch's custom mask packed into a graph's ``custom_mask_buf`` as flashinfer's
        plan would (segment_packbits: each request from a byte boundary, little bit order) and
        the byte offsets into ``mask_indptr_buf``, with no wait for the GPU."""
        device = self.cache.k.device
        packed = packbits(custom_mask(batch, self.sliding_window, device, align=8))       # [sum of bytes]
        nbytes = [-(-q * (p + q) // 8) for p, q in zip(batch.prefix_lens, batch.qo_lens)]
        indptr, = to_device([torch.from_numpy(np.cumsum([0, *nbytes], dtype=np.int32))], device)  # [B + 1]
        buffers["custom_mask_buf"][: len(packed)].copy_(packed)
        buffers["mask_indptr_buf"].copy_(indptr)

    def _graph_state(self, batch: ForwardBatch, decode: bool) -> dict:
        """A graph's own wrapper over fixed buffers sized for its padded shape (module docstring),
        and its static slot mapping."""
        device = self.cache.k.device
        b, n, width = len(batch.request_ids), batch.qo_lens[0], batch.kv_index.shape[1]
        max_pages = b * -(-width // self.cache.page_size)  # each request's KV length is at most W

        def ints(size: int) -> Tensor:
            return torch.zeros(size, dtype=torch.int32, device=device)

        fi = self.flashinfer
        if decode:
            buffers = dict(paged_kv_indptr_buffer=ints(b + 1), paged_kv_indices_buffer=ints(max_pages),
                           paged_kv_last_page_len_buffer=ints(b))
            wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_cuda_graph=True,
                                                            backend="fa2", **buffers)
        else:
            mask_bytes = b * -(-n * width // 8)  # request r packs N * kv_len_r <= N * W bits
            buffers = dict(qo_indptr_buf=ints(b + 1), paged_kv_indptr_buf=ints(b + 1),
                           paged_kv_indices_buf=ints(max_pages), paged_kv_last_page_len_buf=ints(b),
                           custom_mask_buf=torch.zeros(mask_bytes, dtype=torch.uint8, device=device),
                           mask_indptr_buf=ints(b + 1))
            wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", use_cuda_graph=True,
                                                             backend="fa2", **buffers)
        return dict(shape=(b, n, width), decode=decode, wrapper=wrapper, buffers=buffers,
                    slot_mapping=torch.zeros(b * n, dtype=torch.long, device=device))

    @staticmethod
    def _check_graph(graph: dict, batch: ForwardBatch, decode: bool) -> None:
        b, n, width = len(batch.request_ids), batch.qo_lens[0], batch.kv_index.shape[1]
        assert all(q == n for q in batch.qo_lens), "a graph's batch sends N tokens per request"
        assert graph["shape"][:2] == (b, n) and width <= graph["shape"][2], \
            f"graph planned for (B, N, W <=) {graph['shape']}, got {(b, n, width)}"
        if graph["decode"] and not decode:
            raise ValueError("FlashinferBackend: this CUDA graph was captured with the decode kernel, which "
                             "cannot apply a tree mask or a window over tree positions; key graphs on "
                             "uses_decode_kernel(batch) as well")

    def forward(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]; writes k/v into the cache first."""
        k_pool, v_pool = self.cache.k[layer], self.cache.v[layer]
        k_pool.index_copy_(0, self.slot_mapping, k.to(k_pool.dtype))
        v_pool.index_copy_(0, self.slot_mapping, v.to(v_pool.dtype))
        if self.plan_args is not None:  # first layer of this batch, planned lazily
            self._plan_wrapper(q.shape[1], self.plan_args)
            self.plan_args = None
        pages = (-1, self.cache.page_size, *k_pool.shape[1:])                          # [pages, page_size, Hkv, D]
        out = self.wrapper.run(q.to(k_pool.dtype).contiguous(), (k_pool.view(pages), v_pool.view(pages)))
        return out.to(q.dtype)                                                         # [T, Hq, D]
