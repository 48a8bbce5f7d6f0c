"""Greedy tree verification (SGLang ``verify_tree_greedy``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specflow.registry import VERIFIERS
from specflow.sampling import SamplingBatch
from specflow.tree import DraftTree, Verdict, ancestor_mask


@dataclass
class GreedyConfig:
    pass


@VERIFIERS.register("greedy", config=GreedyConfig)
class GreedyVerifier:
    """Follow the target's argmax through the tree.

    From the root, at each depth accept the first child (in index order) whose token is the
    target's argmax at the last accepted node; stop when none is. Bonus = that argmax.
    Lossless only at temperature 0: at higher temperatures it commits the target's mode, not a
    sample (use ``rejection`` there).
    """

    lossless = False

    @classmethod
    def from_config(cls, cfg: GreedyConfig, **_) -> "GreedyVerifier":
        return cls()

    def verify(self, tree: DraftTree, target_logits: Tensor, sampling: SamplingBatch) -> Verdict:
        # temperature, top-k, top-p and min-p all keep the most likely token, so the argmax of the
        # raw logits is the argmax of the processed probs (target_probs): no need to process
        argmax = target_logits.argmax(-1).to(tree.tokens.device)               # [B, N]
        (b, n), depth = argmax.shape, tree.depth_bound()  # (a builder's bound: nothing read back)
        idx = torch.arange(n, device=argmax.device)
        parents = tree.parents.clamp(min=0)
        # a node matches when it is a real draft of its parent's argmax; it is taken when no
        # earlier sibling matches; the walk is every node whose ancestors (and itself) are taken
        match = tree.valid & (idx > 0) & (tree.tokens == argmax.gather(1, parents))              # [B, N]
        earlier = match[:, None, :] & (parents[:, None, :] == parents[:, :, None]) & (idx < idx[:, None])  # [B, N, N]
        taken = (match & ~earlier.any(-1)) | (idx == 0)                                          # [B, N]
        mask = tree.mask if tree.mask is not None else ancestor_mask(tree.parents, depth)       # [B, N, N]
        on_path = ~(mask & ~taken[:, None, :]).any(-1)                                           # [B, N]
        # at most one taken child under each node: the path has one node per depth
        slot = torch.where(on_path, tree.depth, depth + 1)                                       # [B, N]
        accepted = torch.full((b, depth + 2), -1, dtype=torch.long, device=argmax.device)
        accepted = accepted.scatter_(1, slot, idx.expand(b, n))[:, : depth + 1]                  # [B, D + 1]
        accept_len = on_path.sum(1) - 1                                                          # [B]
        last = accepted.gather(1, accept_len[:, None])                                           # [B, 1]
        return Verdict(accepted, accept_len, argmax.gather(1, last)[:, 0])
