"""ModelRunner: a model, its paged KV cache and an attention backend behind one ``extend`` call."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from specflow.runtime.attention import BACKENDS, ForwardBatch
from specflow.runtime.cuda_graph import GraphRunner
from specflow.runtime.kv_cache import OutOfPages, PagedKVCache
from specflow.runtime.transfer import to_device


@dataclass
class ExtendOutput:
    """Outputs of one extend, token-flat and request-major (``offsets[r]`` = first row of request r)."""

    hidden: Tensor              # [T, H] final normed hidden states
    taps: list[Tensor]          # per tapped layer [T, H]: hidden state entering that layer
    logits: Tensor | None       # [T, V] ("all"), [B, V] ("last") or None
    offsets: list[int]

    def rows(self, r: int) -> slice:
        return slice(self.offsets[r], self.offsets[r + 1])


@dataclass
class RuntimeOptions:
    """The runtime settings a drafter's own ModelRunner takes from the engine: attention backend,
    CUDA graphs (padded to ``max_batch_size`` requests), the most tokens one forward prefills
    (``max_prefill_tokens``, None: no bound) and prefix caching."""

    backend: str = "auto"
    cuda_graphs: bool = False
    max_batch_size: int = 32
    max_prefill_tokens: int | None = None
    prefix_caching: bool = False

    def runner(self, model: torch.nn.Module, *, num_pages: int, page_size: int = 1,
               max_tokens_per_request: int = 64) -> "ModelRunner":
        """A runner for ``model``; expansions of up to ``max_tokens_per_request`` nodes per
        request replay from graphs when ``cuda_graphs`` is on and the backend supports them."""
        runner = ModelRunner(model, num_pages=num_pages, page_size=page_size, backend=self.backend,
                             prefix_caching=self.prefix_caching)
        if self.cuda_graphs and runner.attn.supports_graphs:
            runner.enable_graphs(self.max_batch_size, max_tokens_per_request)
        return runner


def token_flat(rows: list | Tensor) -> Tensor:
    """[T] int64 tensor of per-request rows, request-major: a [B, N] tensor where it lies, else
    on the host (int sequences or 1-D tensors; int rows go through numpy, one conversion for the
    whole batch)."""
    if isinstance(rows, Tensor):
        return rows.reshape(-1).long()
    if any(isinstance(r, Tensor) for r in rows):
        return torch.cat([torch.as_tensor(r).view(-1).cpu() for r in rows]).long()
    return torch.from_numpy(np.fromiter(chain.from_iterable(rows), dtype=np.int64))


class ModelRunner:
    """Runs a token-flat model (``forward(input_ids, positions, attn, taps, **inputs)``) over a paged
    KV cache.

    Requests are identified by integer ids; their cache entries appear on first ``extend`` and
    leave with ``release``. ``extend`` raises OutOfPages (with nothing allocated) when the pool
    is full.
    """

    def __init__(self, model: torch.nn.Module, *, num_pages: int, page_size: int = 1,
                 backend: str = "torch", prefix_caching: bool = False):
        cfg = model.config
        param = next(model.parameters())
        self.model = model
        self.device = param.device
        self.cache = PagedKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                                  num_pages, page_size, dtype=param.dtype, device=param.device,
                                  prefix_caching=prefix_caching)
        if backend not in BACKENDS:
            raise ValueError(f"backend: '{backend}' is not one of {', '.join(BACKENDS)}")
        self.attn = BACKENDS[backend](self.cache, sliding_window=cfg.sliding_window,
                                      num_qo_heads=cfg.num_attention_heads)
        self.graphs: GraphRunner | None = None

    def enable_graphs(self, max_batch_size: int, max_tokens_per_request: int) -> None:
        """Run forwards of at most ``max_tokens_per_request`` tokens per request through padded
        CUDA graphs (see specflow.runtime.cuda_graph); on a CPU the same padded static path runs
        eagerly."""
        self.graphs = GraphRunner(self, max_batch_size, max_tokens_per_request, capture=self.device.type == "cuda")

    def kv_len(self, request_id: int) -> int:
        return self.cache.kv_lens.get(request_id, 0)

    @torch.inference_mode()
    def extend(self, request_ids: list[int], token_ids: list | Tensor, *,
               positions: list | Tensor | None = None, tree_masks: list[Tensor | None] | None = None,
               logits: Literal["all", "last", "none"] = "all", taps: tuple[int, ...] = (),
               inputs: dict[str, Tensor] | None = None) -> ExtendOutput:
        """Append tokens to each request's cache and run the model over them.

        Token ids and positions are per-request rows: lists (or ranges) of ints or 1-D tensors, or
        one [B, N] tensor (N tokens each; on the model's device, no value of it is read on the
        host, bar positions under a sliding window). ``positions`` default to consecutive
        positions after the cached prefix; tree verification passes depth-based positions and
        ``tree_masks`` ([q, m >= q] bool over each request's last m tokens, ForwardBatch; None:
        causal). ``inputs`` are extra per-token model inputs,
        token-flat ``[T, ...]`` in the order of ``token_ids`` (e.g. EAGLE's ``features``), passed
        to the model as keyword arguments.
        """
        qo_lens = [token_ids.shape[1]] * len(token_ids) if isinstance(token_ids, Tensor) else [len(t) for t in token_ids]
        prefix_lens = [self.kv_len(r) for r in request_ids]
        tree_masks = tree_masks or [None] * len(request_ids)
        graph_n = self._reserve(request_ids, prefix_lens, qo_lens, tree_masks)
        if positions is None:
            positions = [range(p, p + q) for p, q in zip(prefix_lens, qo_lens)]
        positions = token_flat(positions)                                              # [T]
        inputs = inputs or {}
        eager = [positions] if graph_n is None else []  # (the graph runner lays out its own)
        input_ids, *values = to_device([token_flat(token_ids), *inputs.values(), *eager], self.device)  # one copy
        device_positions = values.pop() if eager else None
        extra = dict(zip(inputs, values))
        assert all(len(t) == len(input_ids) for t in extra.values()), "inputs must be token-flat [T, ...]"
        if graph_n is not None:  # the graph runner lays out the padded batch
            hidden, tapped = self.graphs.forward(list(request_ids), prefix_lens, qo_lens, graph_n, positions,
                                                 tree_masks, input_ids, taps, extra)
        else:
            batch = ForwardBatch.build(self.cache, request_ids, prefix_lens, qo_lens, positions, tree_masks)
            self.attn.plan(batch)
            hidden, tapped = self.model(input_ids, device_positions, self.attn, taps, **extra)
        for r, p, q in zip(request_ids, prefix_lens, qo_lens):
            self.cache.kv_lens[r] = p + q
        offsets = [0]
        for q in qo_lens:
            offsets.append(offsets[-1] + q)
        out_logits = None
        if logits == "all":
            out_logits = self.model.compute_logits(hidden)
        elif logits == "last":
            out_logits = self.model.compute_logits(hidden[[o - 1 for o in offsets[1:]]])
        return ExtendOutput(hidden, list(tapped), out_logits, offsets)

    def _reserve(self, request_ids: list[int], prefix_lens: list[int], qo_lens: list[int],
                 tree_masks: list[Tensor | None]) -> int | None:
        """Reserve the pages of a forward; returns the tokens per request of the graph that runs
        it, or None to run eagerly. A graph may pad requests with tokens past their end; when
        the pool cannot hold those too, the forward runs eagerly."""
        n = self.graphs.tokens_per_request(qo_lens, tree_masks) if self.graphs is not None else None
        if n is not None:
            try:
                self.cache.reserve(request_ids, [p + n for p in prefix_lens])
                return n
            except OutOfPages:
                pass
        self.cache.reserve(request_ids, [p + q for p, q in zip(prefix_lens, qo_lens)])
        return None

    def commit(self, request_ids: list[int], bases: list[int], keeps: list[list[int]]) -> None:
        """Keep each request's K/V of the tree nodes in its entry of ``keeps`` (offsets from its
        logical index in ``bases``), root first (PagedKVCache.commit)."""
        self.cache.commit(request_ids, bases, keeps)

    def release(self, request_ids: list[int]) -> None:
        for r in request_ids:
            self.cache.release(r)
