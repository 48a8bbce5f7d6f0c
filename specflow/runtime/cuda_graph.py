"""CUDA graphs for fixed-shape forwards: decode (1 token per request), tree verification (N
nodes per request) and short causal extends (a drafter catching up on accepted tokens), padded
to captured batch sizes.

A graph is keyed by ``(batch size, tokens per request, taps, extra inputs, the backend's
graph_key)`` (the KV width, for a backend whose tensors have it: TorchBackend's); a batch the
graph's buffers do not fit (``graph_fits``) gets a new graph in its place. Each call pads the
batch with dummy requests up to the captured batch size and the KV width up to a bucket, plans
the attention for the padded batch into the graph's own buffers (the backend's ``plan(batch,
graph=state)``), copies the inputs into the graph's static buffers, then replays. Padding is
rebuilt on every call, so nothing it computes reaches a real token:

- dummy requests (token 0, positions 0..N-1, a causal mask over their own tokens) read and write only
  the reserved padding page, which real rows never see;
- in a causal forward whose requests send different numbers of tokens, each request is padded
  to the graph's N with tokens after its own (token 0, the next logical indices). Its real
  tokens cannot see them (causal), their K/V lands in reserved slots past the request's end
  (never read before a later forward writes them), and their outputs are dropped. When the pool
  cannot hold those slots, the forward runs eagerly. Tree-masked forwards are never padded this
  way: every request must send N tokens.

``capture=False`` runs the very same padded, static-buffer forward eagerly; that is how the CPU
tests check the padding logic that the GPU then captures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, TypeVar

import numpy as np
import torch
from torch import Tensor

from specflow.runtime.attention import ForwardBatch
from specflow.runtime.kv_cache import OutOfPages
from specflow.runtime.transfer import to_device

T = TypeVar("T")
PAD_REQUEST = -1  # cache entry owning the padding page(s) of every graph


def capture_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16 up to ``max_batch_size`` (nano-vllm's ladder)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch_size] + list(range(16, max_batch_size, 16))
    return sizes + [max_batch_size]


def kv_bucket(kv_len: int, smallest: int = 128) -> int:
    """The KV width a graph's batch is padded to: the next power of two >= kv_len (at least ``smallest``)."""
    width = smallest
    while width < kv_len:
        width *= 2
    return width


def token_bucket(n: int, largest: int) -> int:
    """The tokens per request of the graph for a causal forward of up to n: the next power of
    two >= n, at most ``largest``."""
    return min(kv_bucket(n, smallest=1), largest)


@dataclass
class _Graph:
    input_ids: Tensor          # [Bc * N]
    positions: Tensor          # [Bc * N]
    attn_state: dict           # the attention backend's tensors for this graph (see AttentionBackend)
    inputs: dict[str, Tensor]  # extra model inputs (EAGLE's features), [Bc * N, ...] each
    hidden: Tensor | None = None
    taps: list[Tensor] | None = None
    graph: torch.cuda.CUDAGraph | None = None


class GraphRunner:
    """Fixed-shape forwards of a ``ModelRunner``'s model, replayed from CUDA graphs.

    ``tokens_per_request`` says whether a forward can run here, and with how many tokens per
    request. Graphs are captured lazily, the first time each shape is met.
    """

    def __init__(self, runner, max_batch_size: int, max_tokens_per_request: int = 1, capture: bool = True):
        self.runner = runner
        self.sizes = capture_sizes(max_batch_size)
        self.max_tokens_per_request = max_tokens_per_request
        self.capture = capture
        self.graphs: dict[tuple, _Graph] = {}
        self.beams: dict[tuple, object] = {}  # EAGLE-2 beams' graphs (specflow.runtime.beam)
        self.pool = torch.cuda.MemPool() if capture else None  # shared by every graph here (see record)
        # the padding rows' own page(s): their K/V is written there and nowhere else
        try:
            runner.cache.reserve([PAD_REQUEST], [max_tokens_per_request])
        except OutOfPages as e:
            raise ValueError(f"CUDA graphs pad batches with a request of {max_tokens_per_request} tokens, which "
                             f"this KV pool cannot hold ({e}): give the model more KV cache tokens "
                             "(kv_cache_tokens) or turn cuda_graphs off") from None

    def tokens_per_request(self, qo_lens: list[int], tree_masks: list[Tensor | None]) -> int | None:
        """The N of the graph that runs this forward, or None when it must run eagerly (too many
        requests or tokens, or a tree-masked forward whose requests send different numbers).
        A causal forward is padded up to a power of two, so few shapes cover every catch-up."""
        n = max(qo_lens)
        if n > self.max_tokens_per_request or len(qo_lens) > self.sizes[-1]:
            return None
        if all(m is None for m in tree_masks):
            return token_bucket(n, self.max_tokens_per_request)
        return n if all(q == n for q in qo_lens) else None

    @torch.inference_mode()
    def forward(self, request_ids: list[int], prefix_lens: list[int], qo_lens: list[int], n: int,
                positions: Tensor, tree_masks: list[Tensor | None], input_ids: Tensor, taps: tuple[int, ...],
                inputs: dict[str, Tensor]) -> tuple[Tensor, list[Tensor]]:
        """The model's ``(hidden [T, H], taps)`` for a forward laid out as ``ForwardBatch.build``
        takes it (extra token-flat ``inputs`` included), through a padded graph of ``n`` tokens
        per request (``tokens_per_request``; pages reserved for n tokens per request)."""
        b = len(request_ids)
        size = next(s for s in self.sizes if s >= b)
        width = kv_bucket(max(prefix_lens) + n)
        pad = size - b
        # row of every real token in the padded layout; each request's padding follows its tokens
        rows = np.arange(b * n) if all(q == n for q in qo_lens) else \
            np.concatenate([np.arange(r * n, r * n + q) for r, q in enumerate(qo_lens)])         # [T]
        padded_positions = np.arange(size * n) % n + np.repeat(prefix_lens + [0] * pad, n)          # logical indices
        if self.runner.model.config.sliding_window:  # laid out on the host, where the backends read them
            padded_positions[rows] = positions.cpu().numpy()
            rows, padded_positions = torch.from_numpy(rows), torch.from_numpy(padded_positions)
        else:  # laid out on the device: positions that lie there (a tree's) are never waited for
            rows, padded_positions, positions = to_device(
                [torch.from_numpy(rows), torch.from_numpy(padded_positions), positions], self.runner.device)
            padded_positions.index_copy_(0, rows, positions)
        padded = ForwardBatch.build(
            self.runner.cache, request_ids + [PAD_REQUEST] * pad, prefix_lens + [0] * pad, [n] * size,
            padded_positions, tree_masks + [None] * pad, kv_width=width)
        return self._replay(padded, n, rows, input_ids, taps, inputs)

    def _replay(self, padded: ForwardBatch, n: int, rows: Tensor, input_ids: Tensor, taps: tuple[int, ...],
                inputs: dict[str, Tensor]) -> tuple[Tensor, list[Tensor]]:
        """Plan ``padded`` (n tokens per row) into its graph, copy the real tokens' inputs to
        their ``rows`` of the static buffers, replay (capture the first time), and return the
        real rows' outputs."""
        size = len(padded.request_ids)
        key = (size, n, taps, tuple(inputs), self.runner.attn.graph_key(padded))
        g = self.graphs.get(key)
        if g is None or not self.runner.attn.graph_fits(g.attn_state, padded):  # (an outgrown graph goes)
            g = self.graphs[key] = self._new_graph(size * n, inputs)
        self.runner.attn.plan(padded, graph=g.attn_state)
        rows, positions = to_device([rows, padded.positions], self.runner.device)
        g.input_ids.zero_().index_copy_(0, rows, input_ids)
        g.positions.copy_(positions)
        for name, x in inputs.items():
            g.inputs[name].zero_().index_copy_(0, rows, x)
        if g.hidden is None:
            self._record(g, taps)
        elif g.graph is not None:
            g.graph.replay()
        else:
            g.hidden, g.taps = self._run(g, taps)
        return g.hidden.index_select(0, rows), [x.index_select(0, rows) for x in g.taps]

    def _new_graph(self, num_tokens: int, inputs: dict[str, Tensor]) -> _Graph:
        device = self.runner.device
        return _Graph(torch.zeros(num_tokens, dtype=torch.long, device=device),
                      torch.zeros(num_tokens, dtype=torch.long, device=device), {},
                      {name: x.new_zeros(num_tokens, *x.shape[1:]) for name, x in inputs.items()})

    def _run(self, g: _Graph, taps: tuple[int, ...]) -> tuple[Tensor, list[Tensor]]:
        return self.runner.model(g.input_ids, g.positions, self.runner.attn, taps, **g.inputs)

    def _record(self, g: _Graph, taps: tuple[int, ...]) -> None:
        if self.capture:
            g.graph, (g.hidden, g.taps) = record(lambda: self._run(g, taps), self.pool)
        else:
            g.hidden, g.taps = self._run(g, taps)


def record(run: Callable[[], T], pool: torch.cuda.MemPool) -> tuple[torch.cuda.CUDAGraph, T]:
    """Capture ``run()`` (which reads and writes static tensors only) into a CUDA graph that
    allocates from ``pool``, after a warm-up on a side stream (allocator, lazy kernels); the graph
    has run once on return, and ``run()``'s outputs are the tensors every replay overwrites.

    The pool is a ``MemPool`` object, not a bare ``graph_pool_handle()``: the object holds a use
    of the pool while it lives. With a bare handle, replacing the pool's only graph (a batch-1
    decode graph outgrown by its context) leaves the pool unused but still holding memory, and
    PyTorch then refuses every later capture into it ("use_count > 0 INTERNAL ASSERT")."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool.id):
        outputs = run()
    graph.replay()
    return graph, outputs


class RowGraphs:
    """A row-wise function (``fn(x)[i]`` depends on ``x[i]`` only; ``[R, ...] -> [R, ...]``), e.g.
    Medusa's heads over the last hidden states, replayed from a CUDA graph per padded row count
    (``capture_sizes``). Padding rows are zeros and their outputs are dropped; more rows than the
    largest size run eagerly. ``capture=False`` runs the same padded static path eagerly."""

    def __init__(self, fn: Callable[[Tensor], Tensor], max_rows: int, capture: bool = True):
        self.fn = fn
        self.sizes = capture_sizes(max_rows)
        self.capture = capture
        self.pool = torch.cuda.MemPool() if capture else None
        self.graphs: dict[tuple, tuple] = {}  # (size, row shape, dtype) -> (static in, static out, graph or None)

    @torch.inference_mode()
    def __call__(self, x: Tensor) -> Tensor:
        r = len(x)
        if r > self.sizes[-1]:
            return self.fn(x)
        size = next(s for s in self.sizes if s >= r)
        key = (size, x.shape[1:], x.dtype)
        if key not in self.graphs:
            static = x.new_zeros(size, *x.shape[1:])
            graph, out = record(lambda: self.fn(static), self.pool) if self.capture else (None, None)
            self.graphs[key] = (static, out, graph)
        static, out, graph = self.graphs[key]
        static.zero_()[:r].copy_(x)
        if graph is None:
            out = self.fn(static)
        else:
            graph.replay()
        return out[:r].clone()
