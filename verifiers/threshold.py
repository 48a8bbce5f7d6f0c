"""SGLang's thresholded target-only tree sampling (``tree_speculative_sampling_target_only``)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from specflow.registry import VERIFIERS
from specflow.sampling import SamplingBatch, target_probs, uniform
from specflow.tree import DraftTree, Verdict
from verifiers.walk import HostTree, Residual, draft_token_probs, make_verdict, sample_bonus


@dataclass
class ThresholdConfig:
    threshold_single: float = 1.0  # accept any draft whose target prob reaches this
    threshold_acc: float = 1.0     # accept when the coin falls under (summed sibling probs) / this


@VERIFIERS.register("threshold", config=ThresholdConfig)
class ThresholdVerifier:
    """Walk the tree with one coin u per depth, treating every draft as a point mass.

    At the current node with target p, scan its children x in index order:
      prob_acc += p(x)
      accept x  if u < prob_acc / threshold_acc  or  p(x) >= threshold_single
                (then continue at x with prob_acc = 0 and a new coin)
      reject x: p(x) <- 0 in the residual
    If every child is rejected, the bonus is sampled from the renormalised residual. With
    both thresholds 1.0, child j is accepted exactly when u lands in its slice of p's mass
    after the rejected siblings: probability p(x_j), which is lossless. Lower thresholds accept
    more and bias the output toward the drafts.
    """

    def __init__(self, threshold_single: float = 1.0, threshold_acc: float = 1.0):
        if not 0.0 < threshold_single <= 1.0:
            raise ValueError(f"threshold verifier: threshold_single must be in (0, 1], got {threshold_single}")
        if not 0.0 <= threshold_acc <= 1.0:
            raise ValueError(f"threshold verifier: threshold_acc must be in [0, 1], got {threshold_acc}")
        self.threshold_single = threshold_single
        self.threshold_acc = max(threshold_acc, 1e-9)  # as SGLang: no division by zero
        self.lossless = threshold_single == 1.0 and threshold_acc == 1.0

    @classmethod
    def from_config(cls, cfg: ThresholdConfig, **_) -> "ThresholdVerifier":
        return cls(threshold_single=cfg.threshold_single, threshold_acc=cfg.threshold_acc)

    def verify(self, tree: DraftTree, target_logits: Tensor, sampling: SamplingBatch) -> Verdict:
        probs = target_probs(target_logits, sampling)  # [B, N, V], greedy rows one-hot
        host = HostTree.of(tree, draft_token_probs(probs, tree))  # values: p(x) at x's parent
        paths, residuals = [], []
        for b in range(tree.batch_size):
            g = sampling.generators[b]
            node, path = 0, [0]
            while True:
                res = Residual(node)
                coin, prob_acc, accepted = uniform(g), 0.0, None
                for c in host.children(b, node):
                    x = host.tokens[b][c]
                    px = 0.0 if x in res.zeroed else host.values[b][c]
                    prob_acc += px
                    # '<' (not '<=') so a draft with p(x) = 0 never passes on a zero coin
                    if coin < prob_acc / self.threshold_acc or px >= self.threshold_single:
                        accepted = c
                        break
                    res.zeroed.append(x)
                if accepted is None:
                    break
                node = accepted
                path.append(node)
            paths.append(path)
            residuals.append(res)
        bonus = sample_bonus(probs, residuals, sampling.generators)
        return make_verdict(paths, bonus, host.max_depth)
