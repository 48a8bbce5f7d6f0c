"""A drafter model's paged KV cache while it expands draft trees (draft models, EAGLE heads).

Per request the cache holds the committed tokens the drafter has seen, then *scratch*: the tree
nodes fed in the current build, in feeding order. Invariant between steps:
``committed tokens in the cache + pending == every committed token except the root``.

- The first expansion of a tree (frontier = the root) feeds the pending tokens and the root in
  one causal extend.
- Later expansions feed the frontier nodes with a tree mask over the scratch, so each node sees
  the committed prefix, its ancestors and itself. (An EAGLE-2 build runs its later levels as a
  ``beam`` instead, outside the scratch: specflow.runtime.beam.)
- ``commit`` keeps the scratch K/V of the accepted nodes that were fed (always a prefix of the
  accepted path, found by token: a node's K/V depends only on its token path) and queues the
  rest of the accepted path as pending.

Within a build, tree nodes keep their indices (specflow.runtime.draft_scratch).

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

Pending tokens beyond ``max_feed`` (the engine's prefill bound) are fed ahead of a tree, that many
at a time. With prefix caching on the runner's cache, a new request's entries that the cache
holds are committed at once, and a released request's committed entries stay cached; with
``features=True`` they are keyed after the sequence's first token (PrefixCache's root), whose
target feature the first entry reads.

Host work per expansion is numpy over the whole batch; what is left per request is cheap (a
tree start's pending tokens, a view of each mask), so it stays small next to the drafter's
forward at large batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from specflow.runtime.beam import Beam, top_children
from specflow.runtime.draft_scratch import DraftBatch, Scratch, split
from specflow.runtime.model_runner import ModelRunner
from specflow.runtime.transfer import to_device
from specflow.tree import DraftTree, Expansion, Frontier, Roots


@dataclass
class _DraftState:
    slot: int                                             # the request's rows of the runner's Scratch
    committed: int = 0                                    # tokens in the cache before the scratch
    pending: list[int] = field(default_factory=list)
    entries: list[int] = field(default_factory=list)      # prefix caching: every entry's token, committed and pending
    root: int = -1                                        # PrefixCache's root for its entries
    # features=True only:
    pending_features: list[Tensor] = field(default_factory=list)  # chunks [n, F], one row per pending token
    last_feature: Tensor | None = None                             # [1, F] target feature of the token before the root


class TreeDraftRunner:
    """Bookkeeping around a ModelRunner for tree expansion (see module docstring)."""

    def __init__(self, runner: ModelRunner, features: bool = False, max_feed: int | None = None):
        self.runner = runner
        self.features = features
        self.max_feed = max_feed  # pending tokens one forward feeds ahead of a tree (None: all, with its root)
        self.shift = 1 if features else 0  # entry index = token position - shift
        self.states: dict[int, _DraftState] = {}
        self.scratch = Scratch()            # every request's current build
        self.outputs: Tensor | None = None  # features=True: [R, F] model outputs of this build's nodes
        self.epoch = 0                      # builds so far (outputs of older builds are gone)

    def add_pending(self, request_id: int, tokens: list[int], features: Tensor | None = None) -> None:
        """Queue committed tokens; with ``features=True`` also their target features ``[n, F]``.
        With prefix caching, a new request's entries that the cache holds are committed at once."""
        st = self._state(request_id)
        if self.features:
            assert features is not None and len(features) == len(tokens), "one target feature per token"
            if not tokens:
                return
            before = features[:-1]  # [n - 1, F]: the feature each token after the first reads
            if st.last_feature is None:  # the request's first token has no entry: its entries follow it
                st.root, tokens = -2 - tokens[0], tokens[1:]
            else:  # (one token, as a plain step commits: no copy)
                before = torch.cat([st.last_feature, before]) if len(before) else st.last_feature
            st.last_feature = features[-1:]
        cached = 0
        if self.runner.cache.prefix is not None:  # (a table left empty by a build given up is not
            if not st.entries and not st.committed and request_id not in self.runner.cache.block_tables:  # matched)
                cached = st.committed = self.runner.cache.match(request_id, tokens, st.root)
            st.entries.extend(tokens)
        st.pending.extend(tokens[cached:])
        if self.features:
            st.pending_features.append(before[cached:] if cached else before)

    def plan(self, frontier: Frontier) -> DraftBatch:
        """Decide which tokens each request feeds for this expansion.

        All or nothing: the pages are reserved before any state changes, so an OutOfPages
        leaves every request as it was.
        """
        tree, scratch = frontier.tree, self.scratch
        host = torch.cat([frontier.nodes, tree.tokens, tree.parents, tree.positions], 1).cpu().numpy()  # one copy
        c1 = frontier.nodes.shape[1]
        c2, c3 = c1 + tree.num_nodes, c1 + 2 * tree.num_nodes
        nodes_all, tokens_all, parents_all = host[:, :c1], host[:, c1:c2], host[:, c2:c3]  # [B, F], [B, n], [B, n]
        positions_all = host[:, c3:] - self.shift                                         # [B, n]
        counts = (nodes_all >= 0).sum(1)                                                # [B]
        bs = np.flatnonzero(counts)                                                     # [N] requests fed
        starts = (counts[bs] == 1) & (nodes_all[bs] == 0).any(1)                        # [N] feeds its root alone
        roots, inner = np.flatnonzero(starts), np.flatnonzero(~starts)                 # into [N]
        rids = [frontier.roots.request_ids[b] for b in bs]
        states = [self._state(rid) for rid in rids]
        slots = np.array([st.slot for st in states], dtype=np.int64)                     # [N]
        fed = counts[bs]                                                                # [N] tokens to feed
        reserved = fed.copy()  # a tree's start reserves its whole budget (Frontier.budget)
        if len(roots):
            for i in roots[scratch.size[slots[roots]] > 0]:  # a build that never reached commit (a step given up)
                self.runner.cache.truncate(rids[i], states[i].committed)
                scratch.clear(slots[i])
            fed[roots] = [len(states[i].pending) + 1 for i in roots]
            reserved[roots] = fed[roots] + (frontier.budget or 1) - 1
        self.runner.cache.reserve(rids, [self.runner.kv_len(rid) + int(n) for rid, n in zip(rids, reserved)])
        # a new build when every fed request starts a tree and no other is inside one
        batch = DraftBatch(new_build=not len(inner) and not scratch.size.any())
        if len(roots):  # new trees: pending committed tokens, then the root, causal
            root_positions = frontier.roots.positions.tolist()                           # [B], one read
            for i in roots:
                st, b = states[i], bs[i]
                assert st.committed + len(st.pending) == root_positions[b] - self.shift, \
                    "drafter lost track of the sequence"
                batch.request_ids.append(rids[i])
                batch.tokens.append(st.pending + [int(tokens_all[b, 0])])
                batch.positions.append(range(st.committed, st.committed + fed[i]))
                batch.tree_masks.append(None)
                if self.features:
                    assert st.last_feature is not None, "begin() gave no target features for this request"
                    batch.features.extend([*st.pending_features, st.last_feature])
                    st.pending_features = []
                st.committed += len(st.pending)
                st.pending = []
            scratch.start(slots[roots], tokens_all[bs[roots], 0])
            batch.nodes.append((bs[roots], (nodes_all[bs[roots]] == 0).argmax(1), np.cumsum(fed[roots]) - 1,
                                slots[roots], np.zeros(len(roots), dtype=np.int64)))
        if len(inner):  # trees expanded further: fed nodes with a tree mask over the scratch
            b_in, s_in, nodes = bs[inner], slots[inner], nodes_all[bs[inner]]          # [M], [M], [M, F]
            assert (scratch.size[s_in] > 0).all(), "a tree is expanded from its root first"
            n, f, entry = scratch.feed(s_in, nodes, tokens_all[b_in], parents_all[b_in])  # [K] each
            node, ends = nodes[n, f], np.cumsum(fed[inner]).tolist()                   # ends: [M]
            batch.request_ids.extend(rids[i] for i in inner)
            batch.tokens.extend(split(tokens_all[b_in[n], node], ends))
            batch.positions.extend(split(positions_all[b_in[n], node], ends))
            batch.tree_masks.extend(torch.from_numpy(scratch.visible[s, e - c : e, :e])  # [c, scratch]
                                    for s, e, c in zip(s_in, scratch.size[s_in], fed[inner]))
            if self.features:  # a node reads the model's output at its parent
                assert (scratch.epoch[s_in] == self.epoch).all(), "the outputs of this request's tree are gone"
                batch.features.append(scratch.out_row[s_in[n], scratch.parent[s_in[n], entry]])
            batch.nodes.append((b_in[n], f, int(fed[roots].sum()) + np.arange(len(n)), s_in[n], entry))
        return batch

    @torch.inference_mode()
    def expand(self, frontier: Frontier, compute_logits: Callable[[Tensor], Tensor], vocab_size: int,
               to_target: Callable[[Tensor], Tensor] | None = None) -> Expansion:
        """Feed the frontier and answer the top-k of ``compute_logits(hidden)`` per node, on the
        host (the frontier's device).

        ``to_target`` maps the model's token ids to target ids (a smaller draft vocabulary);
        the full q (when asked) is over the target vocabulary, zero outside the draft one.
        """
        b, f, k = *frontier.nodes.shape, frontier.k
        tokens = torch.zeros(b, f, k, dtype=torch.long)
        lps = torch.full((b, f, k), float("-inf"))
        probs = torch.zeros(b, f, vocab_size) if frontier.want_probs else None
        to_target = to_target or (lambda ids: ids)
        fed = self._feed(frontier, compute_logits, vocab_size, to_target)
        if fed is None:
            return Expansion(tokens, lps, probs)
        bi, fi, _, logprobs, top = fed
        bi, fi, top = torch.from_numpy(bi), torch.from_numpy(fi), top.cpu()             # [R, 2k]: one copy
        lps[bi, fi], tokens[bi, fi] = top[:, :k], top[:, k:].long()
        if probs is not None:
            ids = to_target(torch.arange(logprobs.shape[-1], device=logprobs.device))
            q = logprobs.new_zeros(len(logprobs), vocab_size).index_copy_(1, ids, logprobs.exp())  # [R, V]
            probs[bi, fi] = q.cpu()
        return Expansion(tokens, lps, probs)

    def _feed(self, frontier: Frontier, compute_logits: Callable[[Tensor], Tensor], vocab_size: int,
              to_target: Callable[[Tensor], Tensor]) -> tuple[np.ndarray, np.ndarray, Tensor, Tensor, Tensor] | None:
        """Feed the frontier (one forward): the fed nodes' (b, f) [R] on the host, and on the
        model's device their outputs [R, H], log-probs [R, V_draft] and ``top_children`` [R, 2k];
        None when no request feeds a node. Nothing waits for the device."""
        self._catch_up(frontier.roots.request_ids)
        batch = self.plan(frontier)
        if not batch.request_ids:
            return None
        inputs = {"features": self._features(batch.features)} if self.features else None
        out = self.runner.extend(batch.request_ids, batch.tokens, positions=batch.positions,
                                 tree_masks=batch.tree_masks, logits="none", inputs=inputs)
        bi, fi, rows = batch.rows()
        hidden = out.hidden.index_select(0, *to_device([torch.from_numpy(rows)], out.hidden.device))  # [R, H]
        if self.features:
            self._keep_outputs(batch, hidden)
        logprobs = torch.log_softmax(compute_logits(hidden).float(), -1)             # [R, V_draft]
        return bi, fi, hidden, logprobs, top_children(logprobs, frontier.k, to_target, vocab_size)

    def _catch_up(self, request_ids: list[int]) -> None:
        """Feed the pending committed tokens of requests between trees, but the last
        ``max_feed``, ``max_feed`` at a time (no logits): a long prompt reaches the drafter's
        model in forwards no larger than the engine's prefill chunks, not in one."""
        for rid in request_ids:
            st = self.states.get(rid)
            while self.max_feed is not None and st is not None and len(st.pending) > self.max_feed \
                    and not self.scratch.size[st.slot]:
                n = self.max_feed
                features = torch.cat(st.pending_features) if self.features else None         # [pending, F]
                self.runner.extend([rid], [st.pending[:n]], positions=[range(st.committed, st.committed + n)],
                                   logits="none", inputs={"features": features[:n]} if self.features else None)
                st.committed, st.pending = st.committed + n, st.pending[n:]
                if self.features:
                    st.pending_features = [features[n:]]

    def beam(self, roots: Roots, k: int, levels: int, compute_logits: Callable[[Tensor], Tensor],
             vocab_size: int, to_target: Callable[[Tensor], Tensor] | None = None) -> Beam | None:
        """An EAGLE-2 build as a Beam (specflow.runtime.beam): every request of ``roots`` feeds
        its pending tokens and its root, and the roots' top-k children stay on the device
        (``Beam.children``, ``Beam.children_logprobs``), so the host plans the beam's levels
        while the device runs the roots. None, with nothing fed, where a Beam cannot run the
        levels (pages of several slots, a sliding window): the builder then expands level by
        level. Only the roots' K/V outlive the build (``commit``)."""
        if self.runner.cache.page_size != 1 or self.runner.model.config.sliding_window:
            return None
        b = roots.batch_size
        to_target = to_target or (lambda ids: ids)
        frontier = Frontier(roots, DraftTree.root_only(roots), torch.zeros(b, 1, dtype=torch.long), k, False)
        bi, _, hidden, _, top = self._feed(frontier, compute_logits, vocab_size, to_target)  # [B, H], [B, 2k]
        assert np.array_equal(bi, np.arange(b)), "every root is fed, in batch order"
        root_hidden = hidden if self.features else None  # level 1 reads the roots' outputs [B, H]
        return Beam(self.runner, list(roots.request_ids), root_hidden, top[:, k:].long().view(b, 1, k),
                    top[:, :k].view(b, 1, k), k, levels, compute_logits, to_target)

    def _features(self, pieces: list) -> Tensor:
        """Token-flat features [T, F] from a batch's pieces: [n, F] chunks, or arrays of rows of
        ``outputs`` (each run of arrays is one gather)."""
        chunks, rows = [], []
        for piece in [*pieces, None]:
            if isinstance(piece, np.ndarray):
                rows.append(piece)
                continue
            if rows:
                index, = to_device([torch.from_numpy(np.concatenate(rows))], self.outputs.device)
                chunks.append(self.outputs.index_select(0, index))
                rows = []
            if piece is not None:
                chunks.append(piece)
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks)

    def _keep_outputs(self, batch: DraftBatch, hidden: Tensor) -> None:
        """Keep the fed nodes' outputs ``hidden`` [R, F]: their children read them."""
        if batch.new_build:  # every request starts a new tree: no scratch reads older outputs
            self.outputs, self.epoch, start = hidden, self.epoch + 1, 0
        else:
            start, self.outputs = len(self.outputs), torch.cat([self.outputs, hidden])
        slots, entries = batch.entries()
        self.scratch.out_row[slots, entries] = start + np.arange(len(entries))
        self.scratch.epoch[slots] = self.epoch

    def commit(self, request_ids: list[int], tokens: list[list[int]], features: list[Tensor] | None = None) -> None:
        """Each request committed its ``tokens``: the root, then the accepted drafts (with
        ``features=True`` also their target features ``[len(tokens), F]``). The kept scratch K/V
        of the whole batch moves in one cache commit."""
        states = [self._state(rid) for rid in request_ids]
        keeps = [self.scratch.path(st.slot, t[: 1 if self.features else len(t)]) if self.scratch.size[st.slot] else []
                 for st, t in zip(states, tokens)]
        kept = [i for i, keep in enumerate(keeps) if keep]
        if kept:
            self.runner.commit([request_ids[i] for i in kept], [states[i].committed for i in kept],
                               [keeps[i] for i in kept])
        self.scratch.clear(np.array([st.slot for st in states], dtype=np.int64))
        for i, (rid, st, keep, toks) in enumerate(zip(request_ids, states, keeps, tokens)):
            st.committed += len(keep)
            if self.runner.cache.prefix is not None:
                st.entries.extend(toks[:len(keep)])
            if self.features:
                f = features[i]
                assert len(f) == len(toks), "one target feature per token"
                if keep:  # the root's entry stays; the next token reads the root's target feature
                    st.last_feature = f[:1]
                self.add_pending(rid, toks[len(keep):], f[len(keep):])
            else:
                self.add_pending(rid, toks[len(keep):])

    def _state(self, request_id: int) -> _DraftState:
        st = self.states.get(request_id)
        if st is None:
            st = self.states[request_id] = _DraftState(self.scratch.acquire())
        return st

    def release(self, request_ids: list[int]) -> None:
        for rid in request_ids:
            st = self.states.pop(rid, None)
            if st is not None:
                self.scratch.release(st.slot)
                if self.runner.cache.prefix is not None:  # its committed entries stay cached
                    self.runner.cache.insert(rid, st.entries[:st.committed], st.root)
            if rid in self.runner.cache.block_tables:
                self.runner.release([rid])
