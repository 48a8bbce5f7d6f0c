"""A drafter model's paged KV cache while it expands draft trees (draft models, EAGLE heads).

Per request the cache holds the committed tokens the drafter has seen, then *scratch*: the tree
nodes fed in the current build, in feeding order. Invariant between steps:
``committed tokens in the cache + pending == every committed token except the root``.

- The first expansion of a tree (frontier = the root) feeds the pending tokens and the root in
  one causal extend.
- Later expansions feed the frontier nodes with a tree mask over the scratch, so each node sees
  the committed prefix, its ancestors and itself.
- ``commit`` keeps the scratch K/V of the accepted nodes that were fed (always a prefix of the
  accepted path, found by token: a node's K/V depends only on its token path) and queues the
  rest of the accepted path as pending.

Within a build, tree nodes keep their indices (builders grow trees by appending nodes; EAGLE-2
renumbers only in its final rerank, after the last expansion): a node's parent is found by
index, and its scratch entry must carry the parent's token.

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

Host work per expansion is numpy per request, never per node or per scratch entry, so it stays
small next to the drafter's forward at large batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from specflow.runtime.model_runner import ModelRunner
from specflow.tree import Expansion, Frontier


class Scratch:
    """The tree nodes one build fed for a request, in feeding order; entry 0 is the root, and
    ``size == 0`` between builds. Its arrays outlive builds (they only grow)."""

    def __init__(self):
        self.size = 0
        self.token = np.zeros(64, dtype=np.int64)         # [S] token of each entry
        self.parent = np.full(64, -1, dtype=np.int64)     # [S] entry of its parent, -1 at the root
        self.visible = np.zeros((64, 64), dtype=bool)     # [S, S] entry i sees entry j (itself, ancestors)
        self.out_row = np.zeros(64, dtype=np.int64)       # [S] features=True: row of its output in runner.outputs
        self.node = np.full(512, -1, dtype=np.int64)      # [C] tree node -> entry, -1 where not fed

    def start(self, root_token: int) -> None:
        """Begin a build: the root alone."""
        assert self.size == 0, "clear() ends a build"
        self.size = 1
        self.token[0], self.parent[0], self.visible[0, 0], self.node[0] = root_token, -1, True, 0

    def feed(self, nodes: np.ndarray, tokens: np.ndarray, parent_nodes: np.ndarray,
             parent_tokens: np.ndarray, tree_size: int) -> tuple[np.ndarray, np.ndarray]:
        """Add tree ``nodes`` [F] with their ``tokens`` [F] under ``parent_nodes`` [F] (carrying
        ``parent_tokens``) of a tree of ``tree_size`` nodes so far; returns their entries [F]
        and mask rows [F, size] over the scratch."""
        f = len(nodes)
        self._fit(self.size + f, tree_size)
        parents = self.node[parent_nodes]                                            # [F] entries
        assert (parents >= 0).all() and (self.token[parents] == parent_tokens).all(), \
            "a frontier node's parent must have been fed earlier in the build, at the same node index"
        assert (self.node[nodes] < 0).all() and len(np.unique(nodes)) == f, "a tree node is fed once per build"
        new = np.arange(self.size, self.size + f)
        self.node[nodes], self.token[new], self.parent[new] = new, tokens, parents
        self.visible[new] = self.visible[parents]  # a node sees what its parent sees, and itself
        self.visible[new, new] = True
        self.size += f
        return new, self.visible[new, : self.size]

    def clear(self) -> None:
        """End the build."""
        self.visible[: self.size, : self.size] = False
        self.node.fill(-1)
        self.size = 0

    def path(self, tokens: list[int]) -> list[int]:
        """Entries of the longest fed prefix of a token path (``tokens[0]`` is the root)."""
        entries = [0]
        token, parent = self.token[: self.size], self.parent[: self.size]
        for t in tokens[1:]:
            hit = np.flatnonzero((parent == entries[-1]) & (token == t))
            if not len(hit):
                break
            entries.append(int(hit[0]))  # siblings with one token share their K/V: any will do
        return entries

    def _fit(self, entries: int, nodes: int) -> None:
        if nodes > len(self.node):
            self.node = _grown(self.node, (max(nodes, 2 * len(self.node)),), -1)
        if entries > len(self.token):
            cap = max(entries, 2 * len(self.token))
            self.token, self.parent = _grown(self.token, (cap,), 0), _grown(self.parent, (cap,), -1)
            self.out_row, self.visible = _grown(self.out_row, (cap,), 0), _grown(self.visible, (cap, cap), False)


def _grown(a: np.ndarray, shape: tuple[int, ...], fill) -> np.ndarray:
    out = np.full(shape, fill, dtype=a.dtype)
    out[tuple(slice(0, s) for s in a.shape)] = a
    return out


@dataclass
class _DraftState:
    committed: int = 0                                    # tokens in the cache before the scratch
    pending: list[int] = field(default_factory=list)
    scratch: Scratch = field(default_factory=Scratch)    # the current build's fed nodes
    # features=True only:
    pending_features: list[Tensor] = field(default_factory=list)  # chunks [n, F], one row per pending token
    last_feature: Tensor | None = None                             # [F] target feature of the token before the root
    epoch: int = -1                                       # the runner's outputs that scratch.out_row indexes


@dataclass
class DraftBatch:
    """What one expansion sends to the drafter model, before its forward."""

    request_ids: list[int] = field(default_factory=list)
    tokens: list = field(default_factory=list)            # per request, q ids
    positions: list = field(default_factory=list)         # per request, q positions
    tree_masks: list[Tensor | None] = field(default_factory=list)
    # per fed frontier node (concatenated by ``rows``): its (b, f) and its row in the forward's output
    b: list[np.ndarray] = field(default_factory=list)
    f: list[np.ndarray] = field(default_factory=list)
    row: list[np.ndarray] = field(default_factory=list)
    entries: list[tuple[Scratch, np.ndarray]] = field(default_factory=list)  # per request, fed entries
    features: list = field(default_factory=list)  # features=True: [n, F] chunks or rows of the runner's outputs
    new_build: bool = False                       # every tree starts here: earlier outputs are dead

    def rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return np.concatenate(self.b), np.concatenate(self.f), np.concatenate(self.row)


class TreeDraftRunner:
    """Bookkeeping around a ModelRunner for tree expansion (see module docstring)."""

    def __init__(self, runner: ModelRunner, features: bool = False):
        self.runner = runner
        self.features = features
        self.shift = 1 if features else 0  # entry index = token position - shift
        self.states: dict[int, _DraftState] = {}
        self.outputs: Tensor | None = None  # features=True: [R, F] model outputs of this build's nodes
        self.epoch = 0                      # builds so far (outputs of older builds are gone)

    def add_pending(self, request_id: int, tokens: list[int], features: Tensor | None = None) -> None:
        """Queue committed tokens; with ``features=True`` also their target features ``[n, F]``."""
        st = self._state(request_id)
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
        leaves every request as it was.
        """
        tree = frontier.tree
        nodes_all = frontier.nodes.cpu().numpy()                                        # [B, F]
        todo = [(b, rid, np.flatnonzero(nodes_all[b] >= 0)) for b, rid in enumerate(frontier.roots.request_ids)]
        todo = [(b, rid, fs, len(fs) == 1 and nodes_all[b, fs[0]] == 0) for b, rid, fs in todo if len(fs)]
        totals = []
        for _, rid, fs, root in todo:
            st = self._state(rid)
            if root and st.scratch.size:  # a build that never reached commit (e.g. a step given up)
                self.runner.cache.truncate(rid, st.committed)
                st.scratch.clear()
            fed = len(st.pending) + 1 if root else len(fs)
            totals.append(self.runner.kv_len(rid) + fed)
        self.runner.cache.reserve([rid for _, rid, _, _ in todo], totals)
        tokens_all, parents_all = tree.tokens.cpu().numpy(), tree.parents.cpu().numpy()  # [B, n]
        positions_all = tree.positions.cpu().numpy() - self.shift                        # [B, n]
        fed = {rid for _, rid, _, _ in todo}
        # a new build when every fed request starts a tree and no other is inside one
        new_build = all(root for *_, root in todo) and \
            not any(st.scratch.size for rid, st in self.states.items() if rid not in fed)
        batch = DraftBatch(new_build=new_build)
        start = 0  # first row of this request in the forward's output
        for b, rid, fs, root in todo:
            st = self.states[rid]
            if root:  # a new tree: pending committed tokens, then the root, causal
                root_pos = int(frontier.roots.positions[b])
                assert st.committed + len(st.pending) == root_pos - self.shift, "drafter lost track of the sequence"
                tokens = st.pending + [int(tokens_all[b, 0])]
                positions = range(st.committed, st.committed + len(tokens))
                mask = None
                if self.features:
                    assert st.last_feature is not None, "begin() gave no target features for this request"
                    batch.features.extend([*st.pending_features, st.last_feature[None]])
                    st.pending_features = []
                st.committed += len(st.pending)
                st.pending = []
                st.scratch.start(tokens[-1])
                entries, offsets = np.zeros(1, dtype=np.int64), np.array([len(tokens) - 1])
            else:
                assert st.scratch.size, "a tree is expanded from its root first"
                nodes = nodes_all[b, fs]
                parents = parents_all[b, nodes]
                tokens, positions = tokens_all[b, nodes], positions_all[b, nodes]
                entries, mask = st.scratch.feed(nodes, tokens, parents, tokens_all[b, parents], tree.num_nodes)
                mask = torch.from_numpy(mask)                                            # [F, scratch]
                if self.features:  # a node reads the model's output at its parent
                    assert st.epoch == self.epoch, "the outputs of this request's tree are gone"
                    batch.features.append(st.scratch.out_row[st.scratch.parent[entries]])
                offsets = np.arange(len(nodes))
            batch.request_ids.append(rid)
            batch.tokens.append(tokens)
            batch.positions.append(positions)
            batch.tree_masks.append(mask)
            batch.b.append(np.full(len(fs), b))
            batch.f.append(fs)
            batch.row.append(start + offsets)
            batch.entries.append((st, entries))
            start += len(tokens)
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
        inputs = {"features": self._features(batch.features)} if self.features else None
        out = self.runner.extend(batch.request_ids, batch.tokens, positions=batch.positions,
                                 tree_masks=batch.tree_masks, logits="none", inputs=inputs)
        bi, fi, rows = (torch.from_numpy(x) for x in batch.rows())
        hidden = out.hidden.index_select(0, rows.to(out.hidden.device))                 # [R, H]
        if self.features:
            self._keep_outputs(batch, hidden)
        logprobs = torch.log_softmax(compute_logits(hidden).float(), -1)             # [R, V_draft]
        to_target = to_target or (lambda ids: ids)
        kk = min(k, logprobs.shape[-1])
        top_lp, top_ids = logprobs.topk(kk, dim=-1)                                  # [R, kk]
        tokens[bi, fi, :kk] = to_target(top_ids).cpu()
        lps[bi, fi, :kk] = top_lp.cpu()
        if probs is not None:
            ids = to_target(torch.arange(logprobs.shape[-1], device=logprobs.device))
            q = logprobs.new_zeros(len(rows), vocab_size).index_copy_(1, ids, logprobs.exp())  # [R, V]
            probs[bi, fi] = q.cpu()
        return Expansion(tokens, lps, probs)

    def _features(self, pieces: list) -> Tensor:
        """Token-flat features [T, F] from a batch's pieces: [n, F] chunks, or arrays of rows of
        ``outputs`` (each run of arrays is one gather)."""
        chunks, rows = [], []
        for piece in [*pieces, None]:
            if isinstance(piece, np.ndarray):
                rows.append(piece)
                continue
            if rows:
                index = torch.from_numpy(np.concatenate(rows)).to(self.outputs.device)
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
        for st, entries in batch.entries:
            st.scratch.out_row[entries] = start + np.arange(len(entries))
            st.epoch = self.epoch
            start += len(entries)

    def commit(self, request_id: int, tokens: list[int], features: Tensor | None = None) -> None:
        """The request committed ``tokens``: the root, then the accepted drafts (with
        ``features=True`` also their target features ``[len(tokens), F]``)."""
        st = self._state(request_id)
        keep = st.scratch.path(tokens[: 1 if self.features else len(tokens)]) if st.scratch.size else []
        if keep:
            self.runner.commit(request_id, st.committed, keep)
        st.committed += len(keep)
        st.scratch.clear()
        if self.features:
            assert features is not None and len(features) == len(tokens), "one target feature per token"
            if keep:  # the root's entry stays; the next token reads the root's target feature
                st.last_feature = features[0]
            self.add_pending(request_id, tokens[len(keep):], features[len(keep):])
        else:
            self.add_pending(request_id, tokens[len(keep):])

    def _state(self, request_id: int) -> _DraftState:
        st = self.states.get(request_id)
        if st is None:
            st = self.states[request_id] = _DraftState()
        return st

    def release(self, request_ids: list[int]) -> None:
        for rid in request_ids:
            self.states.pop(rid, None)
            if rid in self.runner.cache.block_tables:
                self.runner.release([rid])
