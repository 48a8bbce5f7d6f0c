"""Chain: one draft token per step, ``depth`` steps (classic speculative decoding)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specflow.protocols import Drafter
from specflow.registry import TREE_BUILDERS
from specflow.tree import DraftTree, Roots
from trees.growth import GrowingTree


@dataclass
class ChainConfig:
    depth: int = 4         # draft tokens per step; N = depth + 1
    sample: bool = False   # draw each token from q (non-greedy requests) instead of taking the argmax


@TREE_BUILDERS.register("chain", config=ChainConfig)
class ChainBuilder:
    """Expand the last node with k=1, ``depth`` times: N = depth + 1 nodes.

    A request whose drafter has no child at some step gets padding for its remaining nodes.
    With ``sample=True`` the tokens of non-greedy requests are drawn from q and q is recorded,
    so the rejection verifier performs exactly Leviathan et al.'s speculative sampling.
    """

    def __init__(self, depth: int = 4, sample: bool = False):
        if depth < 1:
            raise ValueError(f"chain tree: depth must be >= 1 (draft tokens per step), got {depth}")
        self.depth, self.sample = depth, sample
        self.num_draft_tokens = depth + 1

    @classmethod
    def from_config(cls, cfg: ChainConfig, **_) -> "ChainBuilder":
        return cls(depth=cfg.depth, sample=cfg.sample)

    def build(self, drafter: Drafter, roots: Roots) -> DraftTree:
        grow = GrowingTree(roots, self.num_draft_tokens, self.sample)
        last = torch.zeros(roots.batch_size, 1, dtype=torch.long, device=roots.tokens.device)  # [B, 1]
        for step in range(1, self.depth + 1):
            tokens, logprobs, sampled = grow.expand(drafter, last, k=1)  # [B, 1, 1]
            grow.add(last, tokens[:, :, 0], logprobs[:, :, 0], sampled[:, :, 0])
            last = torch.where(grow.valid[:, step:step + 1], step, -1)  # node `step`, or none
        return grow.finish()
