"""Attention backends: plan once per forward, run per layer.

Every forward is an *extend*: request r has ``prefix_lens[r]`` tokens already cached and
appends ``qo_lens[r]`` new tokens at logical indices prefix_len .. prefix_len + qo_len - 1.
New tokens see the whole prefix and, among themselves, either a causal mask (prefill, decode)
or a per-request tree mask (verification). A tree mask ``[q, m]`` with m >= q covers the last m
visible tokens (earlier scratch tree nodes, then the new ones), so a drafter expanding a tree
level by level lets each node see only its ancestors. Plain decode is qo_len = 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from specflow.runtime.flashinfer_backend import FlashinferBackend, flashinfer_supports
from specflow.runtime.kv_cache import PagedKVCache
from specflow.runtime.transfer import to_device, to_host


@dataclass
class ForwardBatch:
    """The token-flat layout of one forward (request-major)."""

    request_ids: list[int]
    positions: Tensor                 # [T] rope positions of the new tokens
    prefix_lens: list[int]            # cached tokens per request before this forward
    qo_lens: list[int]                # new tokens per request
    tree_masks: list[Tensor | None]   # per request [q, m >= q] bool over the last m tokens; None = causal
    slot_mapping: Tensor              # [T] pool slot each new token's K/V is written to
    kv_index: Tensor                  # [B, max_kv] pool slots of every visible token (0 past the end)

    @staticmethod
    def build(cache: PagedKVCache, request_ids: list[int], prefix_lens: list[int], qo_lens: list[int],
              positions: Tensor, tree_masks: list[Tensor | None] | None = None,
              kv_width: int | None = None) -> "ForwardBatch":
        """Lay out a forward whose pages are already reserved (index arithmetic in numpy, which
        is several times cheaper than torch for these small arrays). ``kv_width`` pads the KV
        index to a fixed width (CUDA graphs); the extra columns are masked out."""
        rows = cache.batch_slot_array(request_ids, [p + q for p, q in zip(prefix_lens, qo_lens)])  # [B, max_kv]
        if kv_width is not None:  # zero padded (np.pad would cost more than the rest of the layout)
            padded = np.zeros((len(rows), kv_width), dtype=np.int64)                   # [B, kv_width]
            padded[:, : rows.shape[1]] = rows
            rows = padded
        slot_mapping = np.concatenate([row[p : p + q] for row, p, q in zip(rows, prefix_lens, qo_lens)])
        return ForwardBatch(list(request_ids), positions, list(prefix_lens), list(qo_lens),
                            tree_masks or [None] * len(request_ids), torch.from_numpy(slot_mapping),
                            torch.from_numpy(rows))

    def stacked_tree_masks(self, device: torch.device | str) -> Tensor | None:
        """The tree masks as one [B, max_q, max_m] bool tensor, zero padded (None when every
        request is causal): stacked on ``device`` when they all lie there with one shape (a
        target verifying trees built on the device: no copy, no wait), else laid out on the
        host (those on a device brought back in one copy)."""
        masks = [t for t in self.tree_masks if t is not None]
        if not masks:
            return None
        device, max_q = torch.device(device), max(self.qo_lens)
        q, width = masks[0].shape
        if all(t.device == device and t.shape == (q, width) for t in masks):
            blank = masks[0].new_zeros(q, width)  # (a causal request's rows are never read)
            return F.pad(torch.stack([blank if t is None else t for t in self.tree_masks]), (0, 0, 0, max_q - q))
        on_device = [t for t in masks if t.device.type != "cpu"]
        moved = iter(to_host(on_device) if on_device else [])
        trees = np.zeros((len(self.tree_masks), max_q, max(t.shape[1] for t in masks)), dtype=bool)
        for row, t in zip(trees, self.tree_masks):
            if t is not None:
                row[: t.shape[0], : t.shape[1]] = (t if t.device.type == "cpu" else next(moved)).numpy()
        return torch.from_numpy(trees)


class AttentionBackend(Protocol):
    """``plan`` once per forward (host-side work), then ``forward`` per layer.

    A backend with ``supports_graphs`` also plans for CUDA graphs (specflow.runtime.cuda_graph):
    ``plan(batch, graph=state)`` takes the state dict of one captured graph (empty at first), keeps
    in it everything ``forward`` reads (device tensors, which every later plan for that graph
    rewrites in place, so a replay reads the new batch's metadata) and makes it the current plan;
    ``use(state)`` makes a state planned earlier the current plan again, without host work (a
    graph of several forwards, each planned before the replay: specflow.runtime.beam).

    A graph is keyed by its batch size, tokens per request and ``graph_key(batch)``, and one
    state serves every batch of its key that ``graph_fits``; a batch that does not fit (a KV
    index wider than the graph's buffers hold) gets a new graph in place of the old one."""

    supports_graphs: bool

    def graph_key(self, batch: ForwardBatch) -> Hashable:
        """What a graph captured for ``batch`` depends on beyond its batch size and tokens per
        request (its tensors' KV width, which kernel)."""
    def graph_fits(self, graph: dict, batch: ForwardBatch) -> bool:
        """Whether the graph state ``graph`` (planned before) can plan ``batch`` of its key."""
    def plan(self, batch: ForwardBatch, graph: dict | None = None) -> None: ...
    def use(self, graph: dict) -> None: ...
    def forward(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor: ...


class TorchBackend:
    """Portable reference backend (CPU and CUDA, any mask): pad the batch to ``[B, max_q]``
    queries over ``[B, max_kv]`` gathered keys and call scaled_dot_product_attention."""

    supports_graphs = True

    def __init__(self, cache: PagedKVCache, sliding_window: int | None = None, num_qo_heads: int | None = None):
        self.cache = cache  # (num_qo_heads: unused here, q carries it; one constructor for every backend)
        self.sliding_window = sliding_window

    def graph_key(self, batch: ForwardBatch) -> Hashable:
        return batch.kv_index.shape[1]  # the width of every tensor the graph reads

    def graph_fits(self, graph: dict, batch: ForwardBatch) -> bool:
        return True  # (the key has the width)

    def plan(self, batch: ForwardBatch, graph: dict | None = None) -> None:
        device = self.cache.k.device
        b, max_kv = batch.kv_index.shape
        max_q = max(batch.qo_lens)
        p = np.array(batch.prefix_lens)[:, None, None]                                 # [B, 1, 1]
        q = np.array(batch.qo_lens)[:, None, None]                                     # [B, 1, 1]
        i = np.arange(max_q)[None, :, None]                                            # query index
        j = np.arange(max_kv)[None, None, :]                                           # key index
        mask = (j <= p + i) & (j < p + q)  # causal over the new tokens, the whole prefix visible
        new = (i < q)[..., 0]                                                          # [B, max_q]
        window = None
        if self.sliding_window is not None:
            query_pos = np.zeros((b, max_q), dtype=np.int64)
            query_pos[new] = batch.positions.cpu().numpy()
            # committed tokens sit at their index; new tokens at their (tree) positions
            key_pos = np.repeat(np.arange(max_kv)[None], b, 0)                          # [B, max_kv]
            at = np.minimum(p[:, :, 0] + np.arange(max_q)[None], max_kv - 1)           # [B, max_q]
            np.put_along_axis(key_pos, at, np.where(new, query_pos, np.take_along_axis(key_pos, at, 1)), 1)
            window = (query_pos[:, :, None] - key_pos[:, None, :]) < self.sliding_window  # [B, max_q, max_kv]
            mask &= window
        mask[~new] = j[0, 0] == 0  # padded query rows attend to key 0; their output is dropped
        self.shape = (b, max_q, max_kv)
        self.unpadded = bool(new.all())                                                # every request has max_q tokens
        trees = batch.stacked_tree_masks(device)                                       # [B, max_q, max_m]
        host = [batch.kv_index, batch.slot_mapping]                                    # [B, max_kv], [T]
        if not self.unpadded:  # the rows of [B * max_q] the new tokens fill (unpadded: all of them, in order)
            host.append(torch.from_numpy(np.flatnonzero(new)))                         # [T]
        if trees is not None or not mask.all() or graph is not None:  # (every key visible: no mask at all)
            host.append(torch.from_numpy(mask[:, None]))                                # [B, 1, max_q, max_kv]
        if trees is not None:  # request r's last m_r keys follow its tree mask, over its new rows
            m = np.array([0 if t is None else t.shape[1] for t in batch.tree_masks])   # [B]
            col = j[0] - (p + q)[:, 0] + m[:, None]                                     # [B, max_kv] column in its mask
            inside = (col >= 0) & (col < m[:, None])                                    # [B, max_kv]
            col = np.clip(col, 0, trees.shape[2] - 1)
            host += [trees, torch.from_numpy(col), torch.from_numpy(inside), torch.from_numpy(new)]
            if window is not None:
                host.append(torch.from_numpy(window))
        self.kv_index, self.slot_mapping, *visible = to_device(host, device)           # one copy
        self.q_rows = None if self.unpadded else visible.pop(0)
        if trees is not None:  # the tree bits where they lie (a target's trees: on the device)
            visible, trees, col, inside, rows, *windowed = visible
            bits = trees.gather(2, col[:, None, :].expand(b, max_q, max_kv))          # [B, max_q, max_kv]
            bits = bits & windowed[0] if windowed else bits
            visible = [torch.where(inside[:, None, :] & rows[:, :, None], bits, visible[:, 0])[:, None]]
        self.mask = None
        if visible:  # additive float mask: sdpa's CPU kernels are several times faster with it than with bool
            static = (graph or {}).get("mask")
            if static is None:
                self.mask = torch.zeros(visible[0].shape, dtype=self.cache.k.dtype, device=device)
            else:  # a graph's own, rewritten in place
                self.mask = static.zero_()
            self.mask.masked_fill_(~visible[0], float("-inf"))
        if graph is not None:  # a graph replays from the same tensors: write into them in place
            assert graph.get("unpadded", self.unpadded) == self.unpadded, "a graph pads all its batches alike (q_rows)"
            for name in ("kv_index", "mask", "q_rows", "slot_mapping"):
                new, static = getattr(self, name), graph.setdefault(name, getattr(self, name))
                if static is not new:
                    static.copy_(new)
            graph.update(shape=self.shape, unpadded=self.unpadded)
            self.use(graph)

    def use(self, graph: dict) -> None:
        for name, value in graph.items():
            setattr(self, name, value)

    def forward(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]; writes k/v into the cache first."""
        k_pool, v_pool = self.cache.k[layer], self.cache.v[layer]
        k_pool.index_copy_(0, self.slot_mapping, k.to(k_pool.dtype))
        v_pool.index_copy_(0, self.slot_mapping, v.to(v_pool.dtype))
        b, max_q, max_kv = self.shape
        t, hq, d = q.shape
        q_pad = q if self.unpadded else q.new_zeros(b * max_q, hq, d).index_copy_(0, self.q_rows, q)
        q_pad = q_pad.view(b, max_q, hq, d).transpose(1, 2)      # [B, Hq, max_q, D]
        flat = self.kv_index.view(-1)  # index_select: far faster than advanced indexing on CPU
        keys = k_pool.index_select(0, flat).view(b, max_kv, *k_pool.shape[1:]).transpose(1, 2)    # [B, Hkv, max_kv, D]
        values = v_pool.index_select(0, flat).view(b, max_kv, *v_pool.shape[1:]).transpose(1, 2)  # [B, Hkv, max_kv, D]
        out = F.scaled_dot_product_attention(q_pad, keys.to(q.dtype), values.to(q.dtype),
                                             attn_mask=self.mask if self.mask is None else self.mask.to(q.dtype),
                                             enable_gqa=True)
        out = out.transpose(1, 2).reshape(b * max_q, hq, d)        # [B * max_q, Hq, D]
        return out if self.unpadded else out.index_select(0, self.q_rows)  # [T, Hq, D]


def auto_backend(cache: PagedKVCache, sliding_window: int | None = None,
                 num_qo_heads: int | None = None) -> AttentionBackend:
    """flashinfer when CUDA and flashinfer are there and the cache suits it (fp16/bf16, head_dim
    64..512), the portable torch backend otherwise."""
    return (FlashinferBackend if flashinfer_supports(cache) else TorchBackend)(cache, sliding_window, num_qo_heads)


BACKENDS = {"torch": TorchBackend, "flashinfer": FlashinferBackend, "auto": auto_backend}
