"""A drafter model's paged KV cache while it expands draft trees (draft models, EAGLE heads).

Per request the cache holds the committed tokens the drafter has seen, then *scratch*: the tree
nodes expanded in the current build, in expansion order. Invariant between steps:
``committed tokens in the cache + pending == every committed token except the root``.

- The first expansion of a tree (frontier = the root) feeds the pending tokens and the root in
  one causal extend.
- Later expansions feed the frontier nodes with a tree mask over the scratch, so each node sees
  the committed prefix, its ancestors and itself.
- ``commit`` keeps the scratch K/V of the accepted nodes that were expanded (always a prefix of
  the accepted path) and queues the rest of the accepted path as pending.

Scratch nodes are keyed by their token path below the root, not by node index: builders may
renumber nodes after expanding them (EAGLE-2's rerank), and siblings never share a token.

With ``features=True`` (EAGLE-style heads) every token also carries a feature vector, passed to
the model as ``features`` (SafeAILab/EAGLE ``topK_genrate``, SGLang's draft extend):

- The entry of token x_i reads the *target* feature of x_{i-1}; the first token of a request has
  no entry, so entry i is token x_{i+1} at rotary position i (= the token's position - 1) and
  the invariant above counts one token fewer.
- While expanding, a tree node reads the model's output at its parent; the root reads the
  target feature of the token before it (``last_feature``).
- ``commit`` keeps only the root's K/V (the only scratch entry computed from a target feature);
  the accepted drafts are queued again with their target features and recomputed at the next
  expansion.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from specflow.runtime.model_runner import ExtendOutput, ModelRunner
from specflow.tree import Expansion, Frontier


@dataclass
class _DraftState:
    committed: int = 0                                    # tokens in the cache before the scratch
    pending: list[int] = field(default_factory=list)
    scratch: dict[tuple[int, ...], int] = field(default_factory=dict)  # token path -> scratch offset
    visible: dict[tuple[int, ...], list[int]] = field(default_factory=dict)  # token path -> offsets of it and its ancestors
    # features=True only:
    pending_features: list[Tensor] = field(default_factory=list)  # chunks [n, F], one row per pending token
    last_feature: Tensor | None = None                             # [F] target feature of the token before the root
    outputs: dict[tuple[int, ...], Tensor] = field(default_factory=dict)  # token path -> model output [1, F]


@dataclass
class DraftBatch:
    """What one expansion sends to the drafter model, before its forward."""

    request_ids: list[int]
    tokens: list[list[int]]       # per request, q ids
    positions: list[list[int]]    # per request, q positions
    tree_masks: list[Tensor | None]
    rows: list[tuple[int, int, int]]  # (b, f, offset of the frontier node within its request's tokens)
    paths: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)  # (request id, token path) per row
    features: list[Tensor] = field(default_factory=list)  # features=True: [n, F] chunks, token-flat in order


class TreeDraftRunner:
    """Bookkeeping around a ModelRunner for tree expansion (see module docstring)."""

    def __init__(self, runner: ModelRunner, features: bool = False):
        self.runner = runner
        self.features = features
        self.shift = 1 if features else 0  # entry index = token position - shift
        self.states: dict[int, _DraftState] = {}

    def add_pending(self, request_id: int, tokens: list[int], features: Tensor | None = None) -> None:
        """Queue committed tokens; with ``features=True`` also their target features ``[n, F]``."""
        st = self.states.setdefault(request_id, _DraftState())
        if not self.features:
            st.pending.extend(tokens)
            return
        assert features is not None and len(features) == len(tokens), "one target feature per token"
        if not tokens:
            return
        before = features[:-1]  # [n - 1, F]: the feature each token after the first reads
        if st.last_feature is None:  # the request's first token has no entry
            tokens = tokens[1:]
        else:
            before = torch.cat([st.last_feature[None], before])
        st.pending.extend(tokens)
        st.pending_features.append(before)
        st.last_feature = features[-1]

    def plan(self, frontier: Frontier) -> DraftBatch:
        """Decide which tokens each request feeds for this expansion.

        All or nothing: the pages are reserved before any state changes, so an OutOfPages
        leaves every request as it was. Host work is per frontier node and tree depth, never
        per scratch entry: a node's mask row marks the scratch columns of its path's prefixes.
        """
        tree = frontier.tree
        nodes_all = frontier.nodes.tolist()
        todo = [(b, rid, [n for n in nodes_all[b] if n >= 0]) for b, rid in enumerate(frontier.roots.request_ids)]
        todo = [(b, rid, nodes) for b, rid, nodes in todo if nodes]
        totals = []
        for _, rid, nodes in todo:
            st = self.states.setdefault(rid, _DraftState())
            if nodes == [0] and st.scratch:  # a build that never reached commit (e.g. a step given up)
                self.runner.cache.truncate(rid, st.committed)
                st.scratch, st.visible, st.outputs = {}, {}, {}
            fed = len(st.pending) + 1 if nodes == [0] else len(nodes)
            totals.append(self.runner.kv_len(rid) + fed)
        self.runner.cache.reserve([rid for _, rid, _ in todo], totals)
        tokens_all, parents_all = tree.tokens.tolist(), tree.parents.tolist()
        positions_all = (tree.positions - self.shift).tolist()
        batch = DraftBatch([], [], [], [], [])
        for b, rid, nodes in todo:
            st = self.states[rid]
            if nodes == [0]:  # a new tree: pending committed tokens, then the root, causal
                root_pos = int(frontier.roots.positions[b])
                assert st.committed + len(st.pending) == root_pos - self.shift, "drafter lost track of the sequence"
                tokens = st.pending + [tokens_all[b][0]]
                positions = list(range(st.committed, st.committed + len(tokens)))
                mask = None
                if self.features:
                    assert st.last_feature is not None, "begin() gave no target features for this request"
                    batch.features.extend([*st.pending_features, st.last_feature[None]])
                    st.pending_features = []
                st.committed += len(st.pending)
                st.pending = []
                st.scratch, st.visible, st.outputs = {(): 0}, {(): [0]}, {}
                rows, paths = [(b, 0, len(tokens) - 1)], [()]
            else:
                paths = [_token_path(parents_all[b], tokens_all[b], n) for n in nodes]
                assert len(set(paths)) == len(paths) and all(p not in st.scratch for p in paths), \
                    "siblings must carry distinct tokens"
                s = len(st.scratch)
                st.scratch.update((p, s + f) for f, p in enumerate(paths))
                # a node sees its ancestors' columns and its own: its parent's row plus itself
                mask = np.zeros((len(paths), s + len(paths)), dtype=bool)                # [F, s + F]
                for f, p in enumerate(paths):
                    st.visible[p] = st.visible[p[:-1]] + [s + f]
                    mask[f, st.visible[p]] = True
                mask = torch.from_numpy(mask)
                tokens = [tokens_all[b][n] for n in nodes]
                positions = [positions_all[b][n] for n in nodes]
                if self.features:  # a node reads the model's output at its parent, [1, F] each
                    batch.features.extend(st.outputs[p[:-1]] for p in paths)
                rows = [(b, nodes_all[b].index(n), f) for f, n in enumerate(nodes)]
            batch.request_ids.append(rid)
            batch.tokens.append(tokens)
            batch.positions.append(positions)
            batch.tree_masks.append(mask)
            batch.rows.extend(rows)
            batch.paths.extend((rid, p) for p in paths)
        return batch

    @torch.inference_mode()
    def expand(self, frontier: Frontier, compute_logits: Callable[[Tensor], Tensor], vocab_size: int,
               to_target: Callable[[Tensor], Tensor] | None = None) -> Expansion:
        """Feed the frontier and answer the top-k of ``compute_logits(hidden)`` per node.

        ``to_target`` maps the model's token ids to target ids (a smaller draft vocabulary);
        the full q (when asked) is over the target vocabulary, zero outside the draft one.
        """
        b, f, k = *frontier.nodes.shape, frontier.k
        tokens = torch.zeros(b, f, k, dtype=torch.long)
        lps = torch.full((b, f, k), float("-inf"))
        probs = torch.zeros(b, f, vocab_size) if frontier.want_probs else None
        batch = self.plan(frontier)
        if not batch.request_ids:
            return Expansion(tokens, lps, probs)
        inputs = {"features": torch.cat(batch.features)} if self.features else None
        out = self.runner.extend(batch.request_ids, batch.tokens, positions=batch.positions,
                                 tree_masks=batch.tree_masks, logits="none", inputs=inputs)
        rows = self.frontier_rows(batch, out)
        hidden = out.hidden.index_select(0, torch.tensor([r for _, _, r in rows], device=out.hidden.device))  # [R, H]
        if self.features:  # a node's children read its output: [1, F] views
            for (rid, path), row in zip(batch.paths, hidden.split(1)):
                self.states[rid].outputs[path] = row
        logprobs = torch.log_softmax(compute_logits(hidden).float(), -1)             # [R, V_draft]
        to_target = to_target or (lambda ids: ids)
        kk = min(k, logprobs.shape[-1])
        top_lp, top_ids = logprobs.topk(kk, dim=-1)                                  # [R, kk]
        bi, fi = torch.tensor([(r[0], r[1]) for r in rows]).T
        tokens[bi, fi, :kk] = to_target(top_ids).cpu()
        lps[bi, fi, :kk] = top_lp.cpu()
        if probs is not None:
            ids = to_target(torch.arange(logprobs.shape[-1], device=logprobs.device))
            q = logprobs.new_zeros(len(rows), vocab_size).index_copy_(1, ids, logprobs.exp())  # [R, V]
            probs[bi, fi] = q.cpu()
        return Expansion(tokens, lps, probs)

    def frontier_rows(self, batch: DraftBatch, out: ExtendOutput) -> list[tuple[int, int, int]]:
        """``(b, f, flat row of out)`` for every expanded frontier node."""
        starts = {b: out.offsets[i] for i, b in enumerate(dict.fromkeys(r[0] for r in batch.rows))}
        return [(b, f, starts[b] + off) for b, f, off in batch.rows]

    def commit(self, request_id: int, tokens: list[int], features: Tensor | None = None) -> None:
        """The request committed ``tokens``: the root, then the accepted drafts (with
        ``features=True`` also their target features ``[len(tokens), F]``)."""
        st = self.states.setdefault(request_id, _DraftState())
        keep = []
        for depth in range(1 if self.features else len(tokens)):
            offset = st.scratch.get(tuple(tokens[1 : depth + 1]))
            if offset is None:
                break
            keep.append(offset)
        if keep:
            self.runner.commit(request_id, st.committed, keep)
        st.committed += len(keep)
        st.scratch, st.visible, st.outputs = {}, {}, {}
        if self.features:
            assert features is not None and len(features) == len(tokens), "one target feature per token"
            if keep:  # the root's entry stays; the next token reads the root's target feature
                st.last_feature = features[0]
            self.add_pending(request_id, tokens[len(keep):], features[len(keep):])
        else:
            self.add_pending(request_id, tokens[len(keep):])

    def release(self, request_ids: list[int]) -> None:
        for rid in request_ids:
            self.states.pop(rid, None)
            if rid in self.runner.cache.block_tables:
                self.runner.release([rid])


def _token_path(parents: list[int], tokens: list[int], node: int) -> tuple[int, ...]:
    """The tokens from below the root down to ``node`` (the root's path is ``()``)."""
    path = []
    while node > 0:
        path.append(tokens[node])
        node = parents[node]
    return tuple(path[::-1])
