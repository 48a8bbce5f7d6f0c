"""EAGLE-2's beam expanded over per-branch K/V paths, the whole build after the root one CUDA graph.

After the root, an EAGLE-2 build expands a fixed frontier of k nodes per request at every level
(SGLang's multi-step draft, SafeAILab/EAGLE ``topK_genrate``). Give each request k *branches*,
one per frontier position: branch j owns one KV slot per level, and when level d expands, its
slots for levels 1..d-1 hold the K/V of the ancestors of the level's j-th node, copied from its
parent's branch (every layer in one gather). A node then sees the committed prefix (the root
included) and its own branch: plain decode attention over a KV list fixed per row, so every
level's layout is known before the first, and nothing between levels needs the host.

``Beam.run(fn, state, key)`` runs the tree builder's levels ``fn`` (its own selection ops, and
``expand`` once per level) over ``state``. With CUDA graphs on, every level's attention is
planned before the run, the batch is padded to a captured size (padding requests read and
write only the graphs' padding page, and their outputs are dropped), and ``fn`` replays as one
graph recorded per (key, padded size, the backend's graph_key): one replay per build, where a
level-by-level build pays a host round trip, a plan and a launch of every kernel per level
(SGLang's EAGLE draft graph). The host's inputs reach the device in one copy, and the tree
stays there for the target (nothing in a build waits for the device). On a CPU the same padded
static path runs eagerly.

Only the drafter's cache changes hands: the builder still scores and reranks, and ``commit``
keeps the root's K/V alone, as for every EAGLE build (the branch slots go back to the pool).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from specflow.runtime.attention import ForwardBatch
from specflow.runtime.cuda_graph import PAD_REQUEST, kv_bucket, record
from specflow.runtime.model_runner import ModelRunner
from specflow.runtime.transfer import to_device


def top_children(logprobs: Tensor, k: int, to_target: Callable[[Tensor], Tensor], vocab_size: int) -> Tensor:
    """[R, 2k] float32: the top-k log-probs of each row of ``logprobs`` [R, V_draft]
    (descending, -inf past the draft vocabulary), then their ids mapped by ``to_target`` into
    the target's ``vocab_size`` (0 past it), in one tensor so that one copy brings both to the
    host."""
    assert vocab_size < 2**24, "token ids past 2^24 do not round-trip through float32"
    kk = min(k, logprobs.shape[-1])
    top_lp, ids = logprobs.topk(kk, dim=-1)                                     # [R, kk]
    ids = to_target(ids)
    if kk < k:  # fewer draft tokens than children asked
        top_lp, ids = F.pad(top_lp, (0, k - kk), value=float("-inf")), F.pad(ids, (0, k - kk))
    return torch.cat([top_lp, ids.float()], -1)


@dataclass
class _BeamGraph:
    """The static tensors of one recorded beam (S requests, padding included)."""

    state: list[Tensor]        # fn's inputs, [S, ...] each
    branch: Tensor             # [S, L, k] slot of (level, branch)
    positions: Tensor          # [S * k] rotary position of each row's root
    children: Tensor           # [S, 1, k] the roots' children
    hidden: Tensor | None      # [S, H] the model's output at each root (EAGLE-style models)
    attn: list[dict]           # per level: the attention backend's graph state
    outputs: tuple[Tensor, ...] | None = None
    replay: Callable[[], None] | None = None  # once recorded


class Beam:
    """Levels 1..``levels`` of an EAGLE-2 beam of width ``k`` over a drafter ``runner`` whose
    cache ends with each request's root: a draft model, or an EAGLE-style model (``forward(...,
    features=)``), where a node reads its parent's output ``root_hidden`` [B, H] at the roots.

    ``children`` [B, 1, k] are the root's children (target ids) and ``children_logprobs``
    [B, 1, k] their log-probs, on the drafter's device: the builder's first level. Reserves
    ``levels * k`` slots per request past its cache, all or nothing (OutOfPages).
    """

    def __init__(self, runner: ModelRunner, request_ids: list[int], root_hidden: Tensor | None, children: Tensor,
                 children_logprobs: Tensor, k: int, levels: int, compute_logits: Callable[[Tensor], Tensor],
                 to_target: Callable[[Tensor], Tensor]):
        cache = runner.cache
        assert cache.page_size == 1, "a branch slot is a page of its own"
        self.runner, self.k, self.levels = runner, k, levels
        self.compute_logits, self.to_target = compute_logits, to_target
        self.vocab_size = runner.model.config.vocab_size  # the target's: drafts are target ids
        self.request_ids = request_ids
        self.kv0 = np.array([runner.kv_len(r) for r in request_ids], dtype=np.int64)   # [B] prefix, root last
        ends = (self.kv0 + levels * k).tolist()
        cache.reserve(request_ids, ends)
        table = cache.batch_slot_array(request_ids, ends)                                  # [B, W] slots
        b, width = len(request_ids), int(self.kv0.max())
        col = self.kv0[:, None] + np.arange(levels * k)                                     # [B, L * k]
        self.branch_np = np.take_along_axis(table, col, 1).reshape(b, levels, k)           # [B, L, k] slot of (level, branch)
        self.prefix = np.where(np.arange(width) < self.kv0[:, None], table[:, :width], 0)  # [B, P] slots, 0 past kv0
        # what expand reads (on the host until run() moves them, or swaps in a graph's static copies)
        self.rows = b                                                                      # requests, padding included
        self.branch = torch.from_numpy(self.branch_np)                                     # [B, L, k]
        self.positions = torch.from_numpy(np.repeat(self.kv0 - 1, k))                      # [B * k]
        self.children, self.children_logprobs = children, children_logprobs                # [B, 1, k] each
        self.root_hidden = root_hidden                                                     # [B, H]
        self.planned: list[dict] | None = None  # per level, when planned before the run
        self.kv_index: Tensor | None = None     # else every level's KV index, made at the first
        self.tokens, self.hidden, self.level = children, root_hidden, 0

    @torch.inference_mode()
    def run(self, fn: Callable[..., tuple[Tensor, ...]], state: tuple[Tensor, ...],
            key: Hashable) -> tuple[Tensor, ...]:
        """``fn(*state)``: a tree builder's levels, which call ``expand`` once per level and
        return tensors [B, ...]; ``state`` are its inputs [B, ...] (host ones are moved in one
        copy), which it may update in place. Returns fn's outputs on the drafter's device,
        without waiting for it.

        With CUDA graphs on, ``fn`` runs over padded static copies of ``state`` on the drafter's
        device, replayed from a graph recorded per (``key``, shapes): ``fn`` must compute from
        its inputs and ``expand`` alone, with device ops only, and ``key`` name that computation.
        Padding requests' inputs are zeros: what they expand touches the padding slot alone,
        and their outputs are dropped."""
        graphs, b, device = self.runner.graphs, len(self.request_ids), self.runner.device
        if graphs is None or b > graphs.sizes[-1]:  # eager: every level planned before its forward
            *state, self.branch, self.positions = to_device([*state, self.branch, self.positions], device)
            return tuple(fn(*state))
        s = next(size for size in graphs.sizes if size >= b)
        kv_index = self._kv_index(s, kv_bucket(self.prefix.shape[1] + self.levels))
        batches = [self._batch(d, s, kv_index) for d in range(1, self.levels + 1)]
        attn = self.runner.attn
        shapes = tuple((x.shape[1:], x.dtype) for x in state)
        gkey = (key, s, shapes, attn.graph_key(batches[0]))
        g = graphs.beams.get(gkey)
        if g is None or not attn.graph_fits(g.attn[0], batches[0]):  # (levels share a width; outgrown: replaced)
            g = graphs.beams[gkey] = self._new_graph(s, state)
        for batch, planned in zip(batches, g.attn):
            attn.plan(batch, graph=planned)
        pad = self._pad_slot()
        # this build's inputs, moved in one copy, and their static tensors (padding: fill)
        inputs = to_device([*state, self.branch, self.positions, self.children], device)
        statics = [*g.state, g.branch, g.positions, g.children]
        fills = [0] * len(state) + [pad, 0, 0]
        if g.hidden is not None:
            inputs, statics, fills = inputs + [self.root_hidden], statics + [g.hidden], fills + [0]

        def load() -> None:  # this build's inputs into the static tensors (rows past them: padding)
            for static, x, fill in zip(statics, inputs, fills):
                if len(x) == len(static):  # no padding rows (a captured size): no slices either
                    static.copy_(x)
                else:
                    static[: len(x)].copy_(x)
                    static[len(x):].fill_(fill)

        def body() -> tuple[Tensor, ...]:  # every pass starts at the first level, over the static tensors
            self.tokens, self.hidden, self.level = g.children, g.hidden, 0
            return tuple(fn(*g.state))

        load()
        self.rows, self.branch, self.positions, self.planned = s, g.branch, g.positions, g.attn
        self._replay(g, body, load, graphs.pool if graphs.capture else None)
        # (the next replay overwrites them: copies)
        return tuple((out if b == s else out[:b]).clone() for out in g.outputs)

    def _replay(self, g: _BeamGraph, body: Callable[[], tuple[Tensor, ...]], load: Callable[[], None], pool) -> None:
        """Replay ``g`` for this build. The first run records ``body`` (the levels over g's
        static tensors) as capture runs it: a warm-up pass, then the recorded pass, both of
        which update the inputs, so they are loaded again before the replay. With a ``pool``
        the recording is a CUDA graph; without (CPU), the same passes run eagerly and every
        replay re-runs this first build's ``body``, as a graph replays what it recorded: state
        a later build would need but the recording froze shows up on a CPU too."""
        if g.replay is None:
            if pool is not None:
                graph, g.outputs = record(body, pool)
                g.replay = graph.replay
            else:
                body(), body()

                def rerun() -> None:
                    g.outputs = body()
                g.replay = rerun
            load()
        g.replay()

    def _new_graph(self, s: int, state: tuple[Tensor, ...]) -> "_BeamGraph":
        device, k = self.runner.device, self.k
        return _BeamGraph(
            state=[x.new_zeros(s, *x.shape[1:], device=device) for x in state],
            branch=torch.zeros(s, self.levels, k, dtype=torch.long, device=device),
            positions=torch.zeros(s * k, dtype=torch.long, device=device),
            children=torch.zeros(s, 1, k, dtype=torch.long, device=device),
            hidden=None if self.root_hidden is None else self.root_hidden.new_zeros(s, self.root_hidden.shape[-1]),
            attn=[{} for _ in range(self.levels)])

    @torch.inference_mode()
    def expand(self, choice: Tensor) -> tuple[Tensor, Tensor]:
        """Feed the next level: ``choice`` [S, k] picks among the last level's children
        (flattened [F * k], -1: none) and branch j takes the j-th. Returns the children of the
        fed nodes: tokens and log-probs [S, k, k] (descending; -inf under a -1), on the
        drafter's device, as ``choice``. S counts ``run``'s padding requests."""
        assert self.level < self.levels, f"the beam was reserved for {self.levels} levels"
        s, k, cache = self.rows, self.k, self.runner.cache
        d = self.level + 1
        pick = choice.clamp(min=0)                                             # [S, k]
        parent = pick // k                                                     # [S, k] branch of each node's parent
        tokens = self.tokens.reshape(s, -1).gather(1, pick)                    # [S, k]
        inputs = {}
        if self.hidden is not None:  # a node reads its parent's output
            hidden = self.hidden.view(s, -1, self.hidden.shape[-1])            # [S, F, H]
            inputs["features"] = hidden.gather(1, parent[..., None].expand(s, k, hidden.shape[-1])).view(s * k, -1)
        if d > 1:  # branch j takes over its parent's ancestors (gathered before any write)
            src = self.branch[:, : d - 1].gather(2, parent[:, None].expand(s, d - 1, k)).reshape(-1)
            dst = self.branch[:, : d - 1].reshape(-1)                          # [S * (d-1) * k]
            for pool in (cache.k, cache.v):
                pool[:, dst] = pool[:, src]
        if self.planned is None:
            if self.kv_index is None:
                self.kv_index = self._kv_index(s, self.prefix.shape[1] + self.levels)
            self.runner.attn.plan(self._batch(d, s, self.kv_index))
        else:
            self.runner.attn.use(self.planned[d - 1])
        out, _ = self.runner.model(tokens.view(-1), self.positions + d, self.runner.attn, (), **inputs)  # [S * k, H]
        logprobs = torch.log_softmax(self.compute_logits(out).float(), -1)      # [S * k, V_draft]
        top = top_children(logprobs, k, self.to_target, self.vocab_size)        # [S * k, 2k]
        self.tokens, self.level = top[:, k:].long().view(s, k, k), d
        if self.hidden is not None:
            self.hidden = out
        top = top.view(s, k, 2 * k)
        return top[..., k:].long(), top[..., :k].masked_fill((choice < 0)[..., None], float("-inf"))

    def _kv_index(self, s: int, width: int) -> Tensor:
        """[S * k, W] the KV index of every level (W >= P + levels), ``s`` requests (padding past
        this beam's): row (b, j) holds request b's prefix, then branch j's slots of levels
        1..levels, so that level d, which sees the first kv0 + d columns, sees the prefix, its
        node's ancestors and the node; a padding row holds the padding slot alone."""
        b, k, p = len(self.request_ids), self.k, self.prefix.shape[1]
        kv = np.zeros((s, k, width), dtype=np.int64)                            # [S, k, W]
        kv[:b, :, :p] = self.prefix[:, None]
        cols = np.broadcast_to((self.kv0[:, None] + np.arange(self.levels))[:, None], (b, k, self.levels))  # [B, k, L]
        np.put_along_axis(kv[:b], cols, self.branch_np.transpose(0, 2, 1), 2)
        if s > b:
            kv[b:, :, 0] = self._pad_slot()
        return torch.from_numpy(kv.reshape(s * k, width))

    def _pad_slot(self) -> int:
        """The padding request's slot: what padding rows read and write."""
        return int(self.runner.cache.batch_slot_array([PAD_REQUEST], [1])[0, 0])

    def _batch(self, d: int, s: int, kv_index: Tensor) -> ForwardBatch:
        """Level d's layout for ``s`` requests over ``kv_index`` (``_kv_index``): row (b, j)
        writes its K/V to branch j's level-d slot; a padding row sees and writes the padding
        slot alone."""
        b, k = len(self.request_ids), self.k
        slots = self.branch_np[:, d - 1].reshape(-1)                            # [B * k]
        prefix_lens = np.repeat(self.kv0 + d - 1, k)                            # [B * k]: the path before the node
        positions = np.repeat(self.kv0 - 1 + d, k)                              # the root's position + d
        pad = (s - b) * k
        if pad:
            slots = np.concatenate([slots, np.full(pad, self._pad_slot())])
            prefix_lens = np.concatenate([prefix_lens, np.zeros(pad, dtype=np.int64)])
            positions = np.concatenate([positions, np.full(pad, d)])           # (run: zeros + d)
        return ForwardBatch(
            request_ids=[r for r in self.request_ids for _ in range(k)] + [PAD_REQUEST] * pad,
            positions=torch.from_numpy(positions), prefix_lens=prefix_lens.tolist(), qo_lens=[1] * (s * k),
            tree_masks=[None] * (s * k), slot_mapping=torch.from_numpy(slots), kv_index=kv_index)
