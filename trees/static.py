"""Static trees: a fixed set of paths of child ranks (EAGLE-1 / Medusa "choices")."""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass

import torch

from specflow.protocols import Drafter
from specflow.registry import TREE_BUILDERS
from specflow.tree import DraftTree, Roots
from trees.growth import GrowingTree

PRESETS: dict[str, list[list[int]]] = {
    # EAGLE-1's default tree: 25 paths, depth 5
    "mc_sim_7b_63": [
        [0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0],
        [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 2, 1], [1, 0, 0],
        [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1],
    ],
    # Medusa's mc_sim_7b_63 (FasterDecoding/Medusa): 63 paths, 10/28/23/2 nodes at depths 1..4
    "medusa_63": [
        [0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4],
        [2, 0], [0, 5], [0, 0, 1], [5], [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8],
        [0, 0, 2], [3, 0], [0, 9], [8], [9], [1, 0, 0], [0, 2, 0], [1, 2], [0, 0, 3], [4, 0],
        [2, 1], [0, 0, 4], [0, 0, 5], [0, 0, 0, 0], [0, 1, 1], [0, 0, 6], [0, 3, 0], [5, 0],
        [1, 3], [0, 0, 7], [0, 0, 8], [0, 0, 9], [6, 0], [0, 4, 0], [1, 4], [7, 0], [0, 1, 2],
        [2, 0, 0], [3, 1], [2, 2], [8, 0], [0, 5, 0], [1, 5], [1, 0, 1], [0, 2, 1], [9, 0],
        [0, 6, 0], [0, 0, 0, 1], [1, 6], [0, 7, 0],
    ],
}


@dataclass
class StaticConfig:
    choices: list[list[int]] | None = None  # rank paths, e.g. [[0], [1], [0, 0]]
    preset: str | None = None               # or a named tree: see trees.static.PRESETS
    sample: bool = False                    # draw children from q (non-greedy requests) instead of top-k


@dataclass(frozen=True)
class _Level:
    """How to grow one depth: expand ``parents`` (node indices) with k children each and keep
    the flat children ``pick`` (index f * k + rank into the [F, k] answer), in node order."""

    parents: list[int]
    k: int
    pick: list[int]


def check_choices(choices: list[list[int]], sample: bool) -> list[tuple[int, ...]]:
    """Validate rank paths and return them sorted by (depth, path): node i + 1 is path i."""
    paths = [tuple(p) for p in choices]
    if not paths:
        raise ValueError("static tree: choices must hold at least one rank path, e.g. [[0], [1], [0, 0]]")
    for p in paths:
        if not p or any(not isinstance(r, int) or r < 0 for r in p):
            raise ValueError(f"static tree: choice {list(p)} must be a non-empty list of ranks >= 0")
    if len(set(paths)) != len(paths):
        dup = next(p for p in paths if paths.count(p) > 1)
        raise ValueError(f"static tree: choice {list(dup)} appears twice")
    known = set(paths)
    for p in paths:
        if len(p) > 1 and p[:-1] not in known:
            raise ValueError(f"static tree: choice {list(p)} needs its prefix {list(p[:-1])} "
                             "in choices too")
    if sample:  # draws without replacement are verified in draw order: no draw may be skipped
        for p in paths:
            if p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in known:
                raise ValueError(f"static tree: with sample=True child ranks must be 0, 1, ... "
                                 f"without gaps; choice {list(p)} lacks {list(p[:-1] + (p[-1] - 1,))}")
    return sorted(paths, key=lambda p: (len(p), p))


def walk_bound(choices: list[tuple[int, ...]]) -> int:
    """The most children a walk from the root tries (``DraftTree.max_tries``): reaching node x tries
    rank + 1 children at each step of its path, then x's own children are tried, all rejected."""
    children = collections.Counter(p[:-1] for p in choices)
    return max(sum(r + 1 for r in p) + children[p] for p in [(), *choices])


@TREE_BUILDERS.register("static", config=StaticConfig)
class StaticBuilder:
    """A fixed tree of rank paths: path [0, 2] is the third child of the first child of the root.

    Grown level by level: the frontier of depth d is the valid depth-(d-1) nodes that have
    children in the tree, each expanded with k = 1 + the largest child rank needed at depth d.
    A rank the drafter cannot fill (-inf) makes that node and its subtree padding.
    N = len(choices) + 1; nodes are ordered by (depth, path), so siblings follow their rank.
    """

    def __init__(self, choices: list[list[int]] | None = None, preset: str | None = None,
                 sample: bool = False):
        if (choices is None) == (preset is None):
            both = ("; an override merges into the node it overrides, so null the key it had (preset: null or "
                    "choices: null)") if choices is not None else ""
            raise ValueError("static tree: give exactly one of choices (rank paths, e.g. [[0], [1], [0, 0]]) or "
                             f"preset (one of {', '.join(PRESETS)}){both}")
        if preset is not None and preset not in PRESETS:
            raise ValueError(f"static tree: unknown preset {preset!r}; known: {', '.join(PRESETS)}")
        self.sample = sample
        self.choices = check_choices(PRESETS[preset] if preset is not None else choices, sample)
        self.num_draft_tokens = len(self.choices) + 1
        self.levels = self._plan()
        self.max_tries = walk_bound(self.choices)

    @classmethod
    def from_config(cls, cfg: StaticConfig, **_) -> "StaticBuilder":
        choices = None if cfg.choices is None else [list(p) for p in cfg.choices]
        return cls(choices=choices, preset=cfg.preset, sample=cfg.sample)

    def _plan(self) -> list[_Level]:
        node = {(): 0} | {p: i + 1 for i, p in enumerate(self.choices)}
        levels = []
        for d in range(1, len(self.choices[-1]) + 1):
            paths = [p for p in self.choices if len(p) == d]
            parents = sorted({node[p[:-1]] for p in paths})
            slot = {n: f for f, n in enumerate(parents)}
            k = 1 + max(p[-1] for p in paths)
            levels.append(_Level(parents, k, [slot[node[p[:-1]]] * k + p[-1] for p in paths]))
        return levels

    def build(self, drafter: Drafter, roots: Roots) -> DraftTree:
        grow = GrowingTree(roots, self.num_draft_tokens, self.sample)
        dev = roots.tokens.device
        b = roots.batch_size
        for level in self.levels:
            parents = torch.tensor(level.parents, device=dev).expand(b, -1)   # [B, F]
            nodes = torch.where(grow.valid.gather(1, parents), parents, -1)  # invalid -> none
            tokens, logprobs, sampled = grow.expand(drafter, nodes, level.k)  # [B, F, k]
            pick = torch.tensor(level.pick, device=dev)                      # [M]
            grow.add(nodes[:, pick // level.k], tokens.flatten(1)[:, pick],
                     logprobs.flatten(1)[:, pick], sampled.flatten(1)[:, pick])
        return dataclasses.replace(grow.finish(), max_tries=self.max_tries)
