"""Greedy tree verification (SGLang ``verify_tree_greedy``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specflow.registry import VERIFIERS
from specflow.sampling import SamplingBatch
from specflow.tree import DraftTree, Verdict


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
        b, depth = tree.batch_size, tree.depth_bound()  # (a builder's bound: nothing read back)
        node = torch.zeros(b, dtype=torch.long, device=argmax.device)          # [B] last accepted node
        accepted = torch.full((b, depth + 1), -1, dtype=torch.long, device=argmax.device)
        accepted[:, 0] = 0
        alive = torch.ones(b, dtype=torch.bool, device=argmax.device)          # [B] still walking
        for level in range(1, depth + 1):  # every request one depth down at once, no value read back
            target = argmax.gather(1, node[:, None])                          # [B, 1] the target's next token
            hit = tree.valid & (tree.parents == node[:, None]) & (tree.tokens == target)  # [B, N]
            alive &= hit.any(1)
            child = hit.int().argmax(1)                                        # [B] the first hit in index order
            node = torch.where(alive, child, node)
            accepted[:, level] = torch.where(alive, child, -1)
        return Verdict(accepted, (accepted >= 0).sum(1) - 1, argmax.gather(1, node[:, None])[:, 0])
