"""CUDA graphs for fixed-shape forwards: decode (1 token per request) and tree verification
(N nodes per request), padded to captured batch sizes.

A graph is keyed by ``(batch size, tokens per request, KV width, taps, extra inputs, the
backend's graph_key)``. Each call pads the batch with dummy requests up to the captured batch
size and the KV width up to a bucket, plans the attention for the padded batch into the graph's
own buffers (the backend's ``plan(batch, graph=state)``), copies the inputs into the graph's
static buffers, then replays. Padded rows are rebuilt on every call (token 0, position 0, their
own scratch page, a causal mask over their own tokens), so nothing a padded row computes reaches
a real request: they read and write only the reserved padding page, and real rows never see it.

``capture=False`` runs the very same padded, static-buffer forward eagerly; that is how the CPU
tests check the padding logic that the GPU then captures.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specflow.runtime.attention import ForwardBatch

PAD_REQUEST = -1  # cache entry owning the padding page(s) of every graph


def capture_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16 up to ``max_batch_size`` (nano-vllm's ladder)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch_size] + list(range(16, max_batch_size, 16))
    return sizes + [max_batch_size]


def kv_bucket(kv_len: int, smallest: int = 128) -> int:
    """The KV width a graph is captured for: the next power of two >= kv_len (at least ``smallest``)."""
    width = smallest
    while width < kv_len:
        width *= 2
    return width


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

    ``fits(qo_lens)`` says whether a forward can run here (every request sends the same number of
    tokens, at most ``max_tokens_per_request``, and the batch is at most the largest captured
    size). Graphs are captured lazily, the first time each shape is met.
    """

    def __init__(self, runner, max_batch_size: int, max_tokens_per_request: int = 1, capture: bool = True):
        self.runner = runner
        self.sizes = capture_sizes(max_batch_size)
        self.max_tokens_per_request = max_tokens_per_request
        self.capture = capture
        self.graphs: dict[tuple, _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        # the padding rows' own page(s): their K/V is written there and nowhere else
        runner.cache.reserve([PAD_REQUEST], [max_tokens_per_request])

    def fits(self, qo_lens: list[int]) -> bool:
        n = qo_lens[0]
        return n <= self.max_tokens_per_request and len(qo_lens) <= self.sizes[-1] and all(q == n for q in qo_lens)

    @torch.inference_mode()
    def forward(self, request_ids: list[int], prefix_lens: list[int], qo_lens: list[int], positions: Tensor,
                tree_masks: list[Tensor | None], input_ids: Tensor, taps: tuple[int, ...],
                inputs: dict[str, Tensor]) -> tuple[Tensor, list[Tensor]]:
        """The model's ``(hidden [T, H], taps)`` for a forward laid out as ``ForwardBatch.build``
        takes it (pages reserved; extra token-flat ``inputs`` included), through a padded graph."""
        b, n = len(request_ids), qo_lens[0]
        size = next(s for s in self.sizes if s >= b)
        width = kv_bucket(max(p + q for p, q in zip(prefix_lens, qo_lens)))
        pad = size - b
        padded = ForwardBatch.build(
            self.runner.cache, request_ids + [PAD_REQUEST] * pad, prefix_lens + [0] * pad, qo_lens + [n] * pad,
            torch.cat([positions, torch.zeros(pad * n, dtype=torch.long)]), tree_masks + [None] * pad,
            kv_width=width)
        key = (size, n, width, taps, tuple(inputs), self.runner.attn.graph_key(padded))
        g = self.graphs.get(key)
        if g is None:
            g = self.graphs[key] = self._new_graph(size * n, inputs)
        self.runner.attn.plan(padded, graph=g.attn_state)
        t = b * n
        g.input_ids.zero_()[:t].copy_(input_ids)
        g.positions.copy_(padded.positions)
        for name, x in inputs.items():
            g.inputs[name].zero_()[:t].copy_(x)
        if g.hidden is None:
            self._record(g, taps)
        elif g.graph is not None:
            g.graph.replay()
        else:
            g.hidden, g.taps = self._run(g, taps)
        return g.hidden[:t].clone(), [x[:t].clone() for x in g.taps]

    def _new_graph(self, num_tokens: int, inputs: dict[str, Tensor]) -> _Graph:
        device = self.runner.device
        return _Graph(torch.zeros(num_tokens, dtype=torch.long, device=device),
                      torch.zeros(num_tokens, dtype=torch.long, device=device), {},
                      {name: x.new_zeros(num_tokens, *x.shape[1:]) for name, x in inputs.items()})

    def _run(self, g: _Graph, taps: tuple[int, ...]) -> tuple[Tensor, list[Tensor]]:
        return self.runner.model(g.input_ids, g.positions, self.runner.attn, taps, **g.inputs)

    def _record(self, g: _Graph, taps: tuple[int, ...]) -> None:
        if not self.capture:
            g.hidden, g.taps = self._run(g, taps)
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (allocator, lazy kernels) off the capture
            self._run(g, taps)
        torch.cuda.current_stream().wait_stream(side)
        g.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g.graph, pool=self.pool):
            g.hidden, g.taps = self._run(g, taps)
        g.graph.replay()
