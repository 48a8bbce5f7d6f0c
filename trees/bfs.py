"""Breadth-limited BFS tree (SGLang NGRAM's BFS mode): wide near the root, narrowing with depth."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specflow.protocols import Drafter
from specflow.registry import TREE_BUILDERS
from specflow.tree import DraftTree, Roots
from trees.growth import GrowingTree


@dataclass
class BfsConfig:
    min_breadth: int = 1         # children per node never drop below this
    max_breadth: int = 4         # children per node at level 0 (the root's children)
    depth: int = 6               # levels at most
    num_draft_tokens: int = 16   # N, root included


@TREE_BUILDERS.register("bfs", config=BfsConfig)
class BfsBuilder:
    """Level l (0 = the root's children) gives every node of level l - 1 up to
    k_l = max(min_breadth, max_breadth - l) children; nodes are kept in BFS order (parent order,
    then rank) until N nodes or ``depth`` levels.

    Children the drafter does not have (-inf, as an n-gram drafter answers) take no budget:
    each request packs its existing children, so its budget goes deeper instead of to padding.
    """

    def __init__(self, min_breadth: int = 1, max_breadth: int = 4, depth: int = 6,
                 num_draft_tokens: int = 16):
        checks = [
            (min_breadth >= 1, f"min_breadth must be >= 1, got {min_breadth}"),
            (max_breadth >= min_breadth, f"max_breadth must be >= min_breadth ({min_breadth}), got {max_breadth}"),
            (depth >= 1, f"depth must be >= 1, got {depth}"),
            (num_draft_tokens >= 2, f"num_draft_tokens must be >= 2 (root included: 1 is plain decoding), "
                                    f"got {num_draft_tokens}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"bfs tree: {message}")
        self.min_breadth, self.max_breadth = min_breadth, max_breadth
        self.depth, self.num_draft_tokens = depth, num_draft_tokens

    @classmethod
    def from_config(cls, cfg: BfsConfig, **_) -> "BfsBuilder":
        return cls(min_breadth=cfg.min_breadth, max_breadth=cfg.max_breadth, depth=cfg.depth,
                   num_draft_tokens=cfg.num_draft_tokens)

    def breadth(self, level: int) -> int:
        """Children per node at ``level`` (0 = the root's children)."""
        return max(self.min_breadth, self.max_breadth - level)

    def build(self, drafter: Drafter, roots: Roots) -> DraftTree:
        n, b, dev = self.num_draft_tokens, roots.batch_size, roots.tokens.device
        grow = GrowingTree(roots, n)
        count = torch.ones(b, dtype=torch.long, device=dev)        # [B] nodes placed, root included
        frontier = torch.zeros(b, 1, dtype=torch.long, device=dev)  # [B, F] the previous level
        for level in range(self.depth):
            k = self.breadth(level)
            tokens, logprobs, sampled = grow.expand(drafter, frontier, k)  # [B, F, k]
            parents = frontier.repeat_interleave(k, dim=1)                 # [B, F * k] BFS order
            logprobs = logprobs.flatten(1)
            exists = grow.exists(parents, logprobs)
            cols = count.unsqueeze(1) + exists.long().cumsum(1) - 1        # packed after placed nodes
            cols = torch.where(exists, cols, n)                            # n: past the budget
            grow.add(parents, tokens.flatten(1), logprobs, sampled.flatten(1), cols=cols)
            placed = (exists & (cols < n)).sum(1)                          # [B]
            width, least = torch.stack([placed.max(), (count + placed).min()]).tolist()
            if width == 0:
                break
            frontier = count.unsqueeze(1) + torch.arange(width, device=dev)  # this level's nodes
            frontier = torch.where(frontier < (count + placed).unsqueeze(1), frontier, -1)
            count = count + placed
            if least >= n:  # every request's budget is full
                break
        return grow.finish()
