"""Greedy tree verification (SGLang ``verify_tree_greedy``)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from specflow.registry import VERIFIERS
from specflow.sampling import SamplingBatch
from specflow.tree import DraftTree, Verdict
from verifiers.walk import HostTree, make_verdict


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
        argmax = target_logits.argmax(-1).cpu().tolist()  # [B, N]
        host = HostTree.of(tree)
        paths, bonus = [], []
        for b in range(tree.batch_size):
            node, path = 0, [0]
            while True:
                # accept the first child equal to the target's choice after the accepted path
                nxt = next((c for c in host.children(b, node) if host.tokens[b][c] == argmax[b][node]), None)
                if nxt is None:
                    break
                node = nxt
                path.append(node)
            paths.append(path)
            bonus.append(argmax[b][node])
        return make_verdict(paths, bonus, host.max_depth, tree.tokens.device)
