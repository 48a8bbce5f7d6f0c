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
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from specflow.runtime.model_runner import ExtendOutput, ModelRunner
from specflow.tree import Frontier


@dataclass
class _DraftState:
    committed: int = 0                                    # tokens in the cache before the scratch
    pending: list[int] = field(default_factory=list)
    scratch: dict[tuple[int, ...], int] = field(default_factory=dict)  # token path -> scratch offset


@dataclass
class DraftBatch:
    """What one expansion sends to the drafter model, before its forward."""

    request_ids: list[int]
    tokens: list[Tensor]          # per request [q]
    positions: list[Tensor]       # per request [q]
    tree_masks: list[Tensor | None]
    rows: list[tuple[int, int, int]]  # (b, f, offset of the frontier node within its request's tokens)


class TreeDraftRunner:
    """Bookkeeping around a ModelRunner for tree expansion (see module docstring)."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.states: dict[int, _DraftState] = {}

    def add_pending(self, request_id: int, tokens: list[int]) -> None:
        self.states.setdefault(request_id, _DraftState()).pending.extend(tokens)

    def plan(self, frontier: Frontier) -> DraftBatch:
        """Decide which tokens each request feeds for this expansion."""
        tree = frontier.tree
        nodes_all = frontier.nodes.tolist()
        batch = DraftBatch([], [], [], [], [])
        for b, rid in enumerate(frontier.roots.request_ids):
            nodes = [n for n in nodes_all[b] if n >= 0]
            if not nodes:
                continue
            st = self.states.setdefault(rid, _DraftState())
            if nodes == [0]:  # a new tree: pending committed tokens, then the root, causal
                if st.scratch:  # a build that never reached commit (e.g. preempted step)
                    self.runner.cache.truncate(rid, st.committed)
                root_pos = int(frontier.roots.positions[b])
                assert st.committed + len(st.pending) == root_pos, "drafter lost track of the sequence"
                tokens = st.pending + [int(tree.tokens[b, 0])]
                positions = torch.arange(st.committed, root_pos + 1)
                mask = None
                st.committed += len(st.pending)
                st.pending = []
                st.scratch = {(): 0}
                rows = [(b, 0, len(tokens) - 1)]
            else:
                row = tree.tokens[b].tolist()
                paths = [tuple(row[i] for i in tree.path_to(b, n)[1:]) for n in nodes]
                assert all(p not in st.scratch for p in paths)
                cols = sorted(st.scratch, key=st.scratch.get) + paths
                # a column is visible when its path is a prefix of the node's path (ancestor or self)
                mask = torch.tensor([[p[: len(c)] == c for c in cols] for p in paths])  # [F, s + F]
                tokens = tree.tokens[b, nodes].tolist()
                positions = tree.positions[b, nodes]
                for f, p in enumerate(paths):
                    st.scratch[p] = len(cols) - len(paths) + f
                rows = [(b, nodes_all[b].index(n), f) for f, n in enumerate(nodes)]
            batch.request_ids.append(rid)
            batch.tokens.append(torch.tensor(tokens))
            batch.positions.append(positions)
            batch.tree_masks.append(mask)
            batch.rows.extend(rows)
        return batch

    def extend(self, batch: DraftBatch, **kwargs) -> ExtendOutput:
        return self.runner.extend(batch.request_ids, batch.tokens, positions=batch.positions,
                                  tree_masks=batch.tree_masks, **kwargs)

    def frontier_rows(self, batch: DraftBatch, out: ExtendOutput) -> list[tuple[int, int, int]]:
        """``(b, f, flat row of out)`` for every expanded frontier node."""
        starts = {b: out.offsets[i] for i, b in enumerate(dict.fromkeys(r[0] for r in batch.rows))}
        return [(b, f, starts[b] + off) for b, f, off in batch.rows]

    def commit(self, request_id: int, tokens: list[int]) -> None:
        """The request committed ``tokens``: the root, then the accepted drafts."""
        st = self.states.setdefault(request_id, _DraftState())
        keep = []
        for depth in range(len(tokens)):
            offset = st.scratch.get(tuple(tokens[1 : depth + 1]))
            if offset is None:
                break
            keep.append(offset)
        if keep:
            self.runner.commit(request_id, st.committed, keep)
        st.committed += len(keep)
        st.scratch = {}
        self.add_pending(request_id, tokens[len(keep):])

    def release(self, request_ids: list[int]) -> None:
        for rid in request_ids:
            self.states.pop(rid, None)
            if rid in self.runner.cache.block_tables:
                self.runner.release([rid])
