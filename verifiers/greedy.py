"""Exact-match tree verification: SGLang's ``verify_tree_greedy``, and its sampled counterpart."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from specflow.registry import VERIFIERS
from specflow.sampling import SamplingBatch
from specflow.tree import DraftTree, Verdict
from verifiers.walk import exact_match


@dataclass
class GreedyConfig:
    pass


@VERIFIERS.register("greedy", config=GreedyConfig)
class GreedyVerifier:
    """Exact match: follow the target's own tokens through the tree (SGLang ``verify_tree_greedy``
    at temperature 0).

    From the root, at each depth accept the first child (in index order) whose token is the
    target's token at the last accepted node; stop when none is. Bonus = that token. The target's
    token is its argmax for greedy requests and a draw from its processed distribution for sampled
    ones, so the output is the target's at any temperature (``walk.exact_match``). It ignores the
    drafter's q: ``rejection`` uses it, and accepts more of a sampled tree's drafts.
    """

    lossless = True

    @classmethod
    def from_config(cls, cfg: GreedyConfig, **_) -> "GreedyVerifier":
        return cls()

    def verify(self, tree: DraftTree, target_logits: Tensor, sampling: SamplingBatch) -> Verdict:
        return exact_match(tree, target_logits, sampling)
