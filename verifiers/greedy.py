"""Greedy tree verification (SGLang ``verify_tree_greedy``)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from specflow.registry import VERIFIERS
from specflow.sampling import SamplingBatch
from specflow.tree import DraftTree, Verdict
from verifiers.walk import follow


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
        return follow(tree, target_logits.argmax(-1))                                    # [B, N] argmax
