"""A fake flashinfer for CPU tests: the 0.7.2.post1 wrappers' signatures and buffer semantics
(page table and packed mask in buffers that ``run`` reads; fixed, in-place buffers in CUDA-graph
mode), with attention computed in torch."""

import numpy as np
import torch


class _FakeWrapper:
    """What both fake wrappers share with flashinfer 0.7.2.post1's: the page table (and packed
    mask) live in buffers that ``run`` reads. With ``use_cuda_graph`` they are the caller's fixed
    buffers, which ``plan`` writes in place (a prefix for indices and the packed mask, a whole
    ``copy_`` for the rest), so a stale or rebound buffer gives a wrong answer here as on a GPU."""

    @property
    def is_cuda_graph_enabled(self):
        return self.use_cuda_graph

    def _setup(self, kv_layout, use_cuda_graph, backend, buffers):
        assert kv_layout == "NHD" and backend == "fa2"
        self.use_cuda_graph, self.buf, self.plans = use_cuda_graph, buffers, 0
        if use_cuda_graph:
            required = ("qo_indptr", "kv_indptr", "kv_indices", "last_page_len")
            if not all(torch.is_tensor(buffers[k]) for k in required if k in buffers):
                raise ValueError("every buffer must be a torch.Tensor in cudagraph mode")
            self.batch_size = len(buffers["last_page_len"])
            if any(len(buffers[k]) != self.batch_size + 1 for k in ("qo_indptr", "kv_indptr") if k in buffers):
                raise ValueError("indptr buffers must hold batch_size + 1 entries")

    def _plan(self, tables, num_qo_heads, num_kv_heads, page_size, q_data_type, kv_data_type, window_left):
        batch_size = len(tables["last_page_len"])
        if self.use_cuda_graph and batch_size != self.batch_size:
            raise ValueError(f"the batch size is fixed in cudagraph mode: {batch_size} != {self.batch_size}")
        for name, value in tables.items():
            if not self.use_cuda_graph:
                self.buf[name] = value
            elif name in ("kv_indices", "mask"):
                if len(value) > len(self.buf[name]):
                    raise ValueError(f"{name} exceeds the allocated buffer")
                self.buf[name][:len(value)].copy_(value)
            else:
                assert self.buf[name].shape == value.shape
                self.buf[name].copy_(value)
        assert kv_data_type in (None, q_data_type)
        self.heads, self.page_size = (num_qo_heads, num_kv_heads), page_size
        self.dtype, self.window_left = q_data_type, window_left
        self.plans += 1

    def _attend(self, q, paged_kv_cache, qo_indptr, causal, masked):
        k_cache, v_cache = paged_kv_cache                                              # [pages, page_size, Hkv, D]
        assert q.dtype == self.dtype and (q.shape[1], k_cache.shape[2]) == self.heads
        kv_indptr, indices, last = (self.buf[k].tolist() for k in ("kv_indptr", "kv_indices", "last_page_len"))
        out = torch.empty_like(q)
        for r in range(len(last)):
            n, pages = qo_indptr[r + 1] - qo_indptr[r], indices[kv_indptr[r]:kv_indptr[r + 1]]
            kv = (len(pages) - 1) * self.page_size + last[r]
            # [1, Hkv, kv, D] each
            keys, values = (c[pages].flatten(0, 1)[:kv].transpose(0, 1)[None] for c in (k_cache, v_cache))
            i, j = torch.arange(n)[:, None], torch.arange(kv)[None]
            if masked:  # the packed custom mask, little bit order
                m0, m1 = self.buf["mask_indptr"][r:r + 2].tolist()
                bits = np.unpackbits(self.buf["mask"][m0:m1].numpy(), bitorder="little")[:n * kv]
                allowed = torch.from_numpy(bits.reshape(n, kv).astype(bool))
            else:
                allowed = j <= kv - n + i if causal else torch.ones(n, kv, dtype=torch.bool)
            if self.window_left >= 0:
                allowed = allowed & (j >= kv - n + i - self.window_left)
            rows = slice(qo_indptr[r], qo_indptr[r + 1])
            out[rows] = torch.nn.functional.scaled_dot_product_attention(
                q[rows].transpose(0, 1)[None], keys, values, attn_mask=allowed, enable_gqa=True)[0].transpose(0, 1)
        return out


class FakeDecodeWrapper(_FakeWrapper):
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None,
                 backend="auto", jit_args=None):
        self._setup(kv_layout, use_cuda_graph, backend, dict(kv_indptr=paged_kv_indptr_buffer,
                    kv_indices=paged_kv_indices_buffer, last_page_len=paged_kv_last_page_len_buffer))

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
             window_left=-1, q_data_type="float16", kv_data_type=None, non_blocking=True):
        tables = dict(kv_indptr=indptr, kv_indices=indices, last_page_len=last_page_len)
        self._plan(tables, num_qo_heads, num_kv_heads, page_size, q_data_type, kv_data_type, window_left)

    def run(self, q, paged_kv_cache):
        assert q.shape[0] == len(self.buf["last_page_len"])
        return self._attend(q, paged_kv_cache, list(range(q.shape[0] + 1)), causal=True, masked=False)


class FakePrefillWrapper(_FakeWrapper):
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, qo_indptr_buf=None,
                 paged_kv_indptr_buf=None, paged_kv_indices_buf=None, paged_kv_last_page_len_buf=None,
                 custom_mask_buf=None, mask_indptr_buf=None, backend="auto", jit_args=None, jit_kwargs=None):
        self._setup(kv_layout, use_cuda_graph, backend, dict(
            qo_indptr=qo_indptr_buf, kv_indptr=paged_kv_indptr_buf, kv_indices=paged_kv_indices_buf,
            last_page_len=paged_kv_last_page_len_buf, mask=custom_mask_buf, mask_indptr=mask_indptr_buf))
        self.max_rows = None

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim_qk, page_size, head_dim_vo=None, custom_mask=None, packed_custom_mask=None,
             causal=False, window_left=-1, q_data_type="float16", kv_data_type=None, non_blocking=True,
             uniform_q_len=None):
        assert packed_custom_mask is None
        q_lens = (qo_indptr[1:] - qo_indptr[:-1]).tolist()
        if self.use_cuda_graph:
            self.max_rows = self.max_rows or sum(q_lens)
            if sum(q_lens) > self.max_rows:
                raise ValueError("more rows than at the first plan in cudagraph mode")
        assert uniform_q_len is None or set(q_lens) == {uniform_q_len}, "a wrong uniform_q_len hint"
        tables = dict(qo_indptr=qo_indptr, kv_indptr=paged_kv_indptr, kv_indices=paged_kv_indices,
                      last_page_len=paged_kv_last_page_len)
        if custom_mask is not None:  # pack per request, as segment_packbits does
            kv_lens = (paged_kv_indptr[1:] - paged_kv_indptr[:-1] - 1) * page_size + paged_kv_last_page_len
            sizes = [n * int(kv) for n, kv in zip(q_lens, kv_lens)]
            assert len(custom_mask) == sum(sizes)
            packed = [np.packbits(m, bitorder="little") for m in np.split(custom_mask.numpy(), np.cumsum(sizes)[:-1])]
            tables["mask"] = torch.from_numpy(np.concatenate(packed))
            tables["mask_indptr"] = torch.tensor(np.cumsum([0] + [len(m) for m in packed]), dtype=torch.int32)
            if self.use_cuda_graph and self.buf["mask"] is None:
                raise ValueError("custom_mask_buf must be initialized with a torch.Tensor in cuda graph mode")
        elif not self.use_cuda_graph:
            tables["mask"] = tables["mask_indptr"] = None
        self.causal = causal
        self._plan(tables, num_qo_heads, num_kv_heads, page_size, q_data_type, kv_data_type, window_left)

    def run(self, q, paged_kv_cache):
        qo_indptr = self.buf["qo_indptr"].tolist()
        assert q.shape[0] == qo_indptr[-1]
        # like flashinfer's run: a custom mask buffer (always there in cudagraph mode) means a masked run
        return self._attend(q, paged_kv_cache, qo_indptr, self.causal, masked=self.buf["mask"] is not None)
