"""What flashinfer's ``plan`` reads, made from a ForwardBatch: the CSR page table of every row and
the custom (tree / sliding-window) mask, flat or packed into bits (specflow.runtime.flashinfer_backend)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from specflow.runtime.kv_cache import PagedKVCache
from specflow.runtime.transfer import to_device

if TYPE_CHECKING:
    from specflow.runtime.attention import ForwardBatch


def page_table(cache: PagedKVCache, batch: ForwardBatch) -> tuple[Tensor, Tensor, Tensor]:
    """flashinfer's CSR page table of the visible tokens (prefix + new) of every row, read off
    ``batch.kv_index`` (a page is the slot of its first token // page_size), so rows need not be
    block tables (an EAGLE-2 beam's branches): ``indptr`` [B + 1], ``indices`` [indptr[-1]] page
    ids, ``last_page_len`` [B]; int32, CPU."""
    ps = cache.page_size
    kv_lens = np.add(batch.prefix_lens, batch.qo_lens)                                 # [B]
    num_pages = -(-kv_lens // ps)                                                      # [B]
    indptr = np.concatenate([[0], np.cumsum(num_pages)]).astype(np.int32)
    indices = np.empty(indptr[-1], dtype=np.int32)                                     # row-major
    firsts = batch.kv_index.numpy()[:, ::ps]                                           # [B, max pages] first slot of each page
    # row slices: several times faster than one boolean index over [B, max pages]
    for row, start, end in zip(firsts, indptr[:-1].tolist(), indptr[1:].tolist()):
        indices[start:end] = row[: end - start]
    if ps > 1:
        indices //= ps
    last_page_len = (kv_lens - (num_pages - 1) * ps).astype(np.int32)
    return torch.from_numpy(indptr), torch.from_numpy(indices), torch.from_numpy(last_page_len)


def positions_are_indices(batch: ForwardBatch) -> bool:
    """Whether every new token's position is its logical index (prefix_len + i): then a
    sliding window over indices (flashinfer's ``window_left``) equals one over positions."""
    index = np.concatenate([np.arange(p, p + n) for p, n in zip(batch.prefix_lens, batch.qo_lens)])  # [T]
    return np.array_equal(batch.positions.cpu().numpy(), index)


def custom_mask(batch: ForwardBatch, sliding_window: int | None = None,
                device: torch.device | str = "cpu", align: int = 1) -> Tensor:
    """Flattened bool mask, length sum(qo_len * kv_len), request-major, row-major per request;
    with ``align`` each request's bits start at a multiple of ``align`` (False in the gaps).

    Request r's new token i sees logical index j < kv_len when j <= prefix_len + i (the prefix
    and causal new tokens); a tree mask ``[q, m]`` replaces the last m columns; a sliding window
    keeps keys with ``query_pos - key_pos < window``, where committed tokens sit at their index
    and new tokens at their (tree) positions. This is TorchBackend's mask, unpadded.

    Built by torch ops over every bit at once on ``device`` (the cache's: on a GPU no host loop
    over requests, and only tree masks that lie on the host, never the prefix columns, cross to
    the device).
    """
    b, qo_lens = len(batch.request_ids), batch.qo_lens
    m = [0 if t is None else t.shape[1] for t in batch.tree_masks]  # request r's tree mask: its last m_r columns
    host = [torch.tensor(batch.prefix_lens), torch.tensor(qo_lens), torch.tensor(m)]    # (m_r = 0 where causal)
    trees = batch.stacked_tree_masks(device)                                            # [B, max_q, max_m] or None
    if sliding_window is not None:
        host.append(batch.positions)                                                    # [T]
    p, n, m, *rest = to_device(host if trees is None else [*host, trees], device)       # [B] each: one copy
    trees = rest.pop() if trees is not None else None
    kv = p + n
    sizes = n * kv                                                                      # [B] bits per request
    spans = (sizes + align - 1) // align * align                                        # [B] with the gap after
    total = sum(-(-q * (pre + q) // align) * align for pre, q in zip(batch.prefix_lens, qo_lens))
    r = torch.repeat_interleave(torch.arange(b, device=device), spans, output_size=total)  # [S] request of each bit
    k = torch.arange(total, device=device) - (torch.cumsum(spans, 0) - spans)[r]       # [S] bit within the request
    gap = k >= sizes[r]                                                                 # [S] (read as bit 0, cleared)
    k = k.masked_fill(gap, 0)
    i, j = k // kv[r], k % kv[r]                                                        # [S] query row, key column
    new = j - p[r]                                                                      # [S] key among the new tokens (< 0: prefix)
    mask = new <= i
    if trees is not None:
        col = j - (kv - m)[r]                                                           # [S] column in the tree mask
        bit = trees[r, i, col.clamp(min=0)]                                             # [S]
        mask = torch.where(col >= 0, bit, mask)  # (no boolean indexing: that would sync with the host)
    if sliding_window is not None:
        positions = rest.pop(0)
        first = (torch.cumsum(n, 0) - n)[r]                                             # [S] row of the request's first new token
        query_pos = positions[first + i]
        key_pos = torch.where(new >= 0, positions[first + new.clamp(min=0)], j)
        mask &= (query_pos - key_pos) < sliding_window
    return mask & ~gap


def packbits(bits: Tensor) -> Tensor:
    """[8 * n] bool -> [n] uint8, little bit order (bit t of byte i is bits[8 * i + t])."""
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)  # (made on the device: no copy)
    return (bits.view(-1, 8).to(torch.uint8) << shifts).sum(-1, dtype=torch.uint8)
