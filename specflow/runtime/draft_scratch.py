"""A drafter's build in progress: the tree nodes each request fed so far (``Scratch``) and what
one expansion sends to the drafter model (``DraftBatch``), for specflow.runtime.draft_runner.

Within a build, tree nodes keep their indices (builders grow trees by appending nodes; EAGLE-2
renumbers only in its final rerank, after the last expansion): a node's parent is found by
index, and its scratch entry must carry the parent's token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from torch import Tensor


class Scratch:
    """The tree nodes every request fed in its current build, in feeding order. A request owns a
    slot s: ``size[s]`` entries, entry 0 its root (``size[s] == 0`` between builds). Arrays grow,
    never shrink; ``start``, ``feed`` and ``clear`` work on the whole batch at once (``path``
    serves one request's commit). ``visible`` is slots x S x S for the largest build S so far
    (1 MB for 64 requests at S = 128)."""

    def __init__(self, slots: int = 8, entries: int = 64, nodes: int = 512):
        self.size = np.zeros(slots, dtype=np.int64)                       # [R] entries of each slot's build
        self.token = np.zeros((slots, entries), dtype=np.int64)           # [R, S] token of each entry
        self.parent = np.full((slots, entries), -1, dtype=np.int64)       # [R, S] entry of its parent, -1 at the root
        self.visible = np.zeros((slots, entries, entries), dtype=bool)    # [R, S, S] entry i sees entry j (itself, ancestors)
        self.node = np.full((slots, nodes), -1, dtype=np.int64)           # [R, C] tree node -> entry, -1 where not fed
        self.out_row = np.zeros((slots, entries), dtype=np.int64)         # [R, S] features=True: row of its output in runner.outputs
        self.epoch = np.full(slots, -1, dtype=np.int64)                   # [R] features=True: the outputs out_row indexes
        self._free = list(range(slots - 1, -1, -1))

    def acquire(self) -> int:
        """A free slot for a new request."""
        if not self._free:
            r = len(self.size)
            self._fit(r + 1, self.token.shape[1], self.node.shape[1])
            self._free = list(range(len(self.size) - 1, r - 1, -1))
        return self._free.pop()

    def release(self, slot: int) -> None:
        assert slot not in self._free, "a slot is released once"
        self.clear(slot)
        self._free.append(slot)

    def start(self, slots: np.ndarray, root_tokens: np.ndarray) -> None:
        """Begin a build in each of ``slots`` [N]: the root alone, with ``root_tokens`` [N]."""
        assert not self.size[slots].any(), "clear() ends a build"
        self.size[slots], self.token[slots, 0], self.parent[slots, 0] = 1, root_tokens, -1
        self.visible[slots, 0, 0], self.node[slots, 0] = True, 0

    def feed(self, slots: np.ndarray, nodes: np.ndarray, tokens: np.ndarray,
             parents: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Add the tree ``nodes`` [N, F] (-1: none) of the requests in ``slots`` [N], whose trees
        so far have ``tokens`` [N, n] and ``parents`` [N, n]. Returns the fed nodes, row-major:
        their row and column in ``nodes`` and their entries, each [K]; a slot's new entries are
        consecutive."""
        fed = nodes >= 0                                                        # [N, F]
        first = self.size[slots]                                                # [N] each slot's new entries:
        end = first + fed.sum(1)                                                # [N] first .. end - 1
        self._fit(len(self.size), int(end.max()), tokens.shape[1])
        n, f = np.nonzero(fed)                                                  # [K]
        s, node = slots[n], nodes[n, f]                                         # [K]
        entry = first[n] + np.cumsum(fed, 1)[n, f] - 1                          # [K]
        parent_node = parents[n, node]                                          # [K]
        parent = self.node[s, parent_node]                                      # [K] entries
        assert (parent >= 0).all() and (self.token[s, parent] == tokens[n, parent_node]).all(), \
            "a frontier node's parent must have been fed earlier in the build, at the same node index"
        key = np.sort(s * tokens.shape[1] + node)                               # [K] (slot, node), sorted
        assert (self.node[s, node] < 0).all() and (key[1:] != key[:-1]).all(), "a tree node is fed once per build"
        self.node[s, node], self.token[s, entry], self.parent[s, entry] = entry, tokens[n, node], parent
        self.visible[s, entry] = self.visible[s, parent]  # a node sees what its parent sees, and itself
        self.visible[s, entry, entry] = True
        self.size[slots] = end
        return n, f, entry

    def clear(self, slots) -> None:
        """End the build of a slot (or of an array of slots)."""
        m = int(np.max(self.size[slots], initial=0))
        self.visible[slots, :m, :m] = False
        self.node[slots] = -1
        self.size[slots] = 0

    def path(self, slot: int, tokens: list[int]) -> list[int]:
        """Entries of the longest fed prefix of a token path (``tokens[0]`` is the root)."""
        entries = [0]
        token, parent = self.token[slot, : self.size[slot]], self.parent[slot, : self.size[slot]]
        for t in tokens[1:]:
            hit = np.flatnonzero((parent == entries[-1]) & (token == t))
            if not len(hit):
                break
            entries.append(int(hit[0]))  # siblings with one token share their K/V: any will do
        return entries

    def _fit(self, slots: int, entries: int, nodes: int) -> None:
        have = (len(self.size), self.token.shape[1], self.node.shape[1])
        if slots <= have[0] and entries <= have[1] and nodes <= have[2]:
            return
        r, s, c = (h if n <= h else max(n, 2 * h) for n, h in zip((slots, entries, nodes), have))  # at least double
        self.size, self.epoch = _grown(self.size, (r,), 0), _grown(self.epoch, (r,), -1)
        self.token, self.parent = _grown(self.token, (r, s), 0), _grown(self.parent, (r, s), -1)
        self.out_row, self.node = _grown(self.out_row, (r, s), 0), _grown(self.node, (r, c), -1)
        self.visible = _grown(self.visible, (r, s, s), False)


@dataclass
class DraftBatch:
    """What one expansion sends to the drafter model, before its forward: requests starting a
    tree first, then requests inside one."""

    request_ids: list[int] = field(default_factory=list)
    tokens: list = field(default_factory=list)            # per request, q ids
    positions: list = field(default_factory=list)         # per request, q positions
    tree_masks: list[Tensor | None] = field(default_factory=list)  # views of Scratch.visible: use before the next plan
    # chunks of fed frontier nodes, [K] arrays: (b, f), row in the forward's output, scratch (slot, entry)
    nodes: list[tuple[np.ndarray, ...]] = field(default_factory=list)
    features: list = field(default_factory=list)  # features=True: [n, F] chunks or rows of the runner's outputs
    new_build: bool = False                       # every tree starts here: earlier outputs are dead

    def rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The fed nodes' (b, f) and rows in the forward's output, each [K]."""
        return self._field(0), self._field(1), self._field(2)

    def entries(self) -> tuple[np.ndarray, np.ndarray]:
        """The fed nodes' scratch (slot, entry), each [K]."""
        return self._field(3), self._field(4)

    def _field(self, i: int) -> np.ndarray:
        return np.concatenate([chunk[i] for chunk in self.nodes])


def split(a: np.ndarray, ends: list[int]) -> list[np.ndarray]:
    """``a`` cut before each of ``ends`` (np.split costs more for a few pieces)."""
    return [a[i:j] for i, j in zip([0, *ends], ends)]


def _grown(a: np.ndarray, shape: tuple[int, ...], fill) -> np.ndarray:
    out = np.full(shape, fill, dtype=a.dtype)
    out[tuple(slice(0, s) for s in a.shape)] = a
    return out
