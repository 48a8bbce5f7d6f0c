"""SGLang's thresholded target-only tree sampling (``tree_speculative_sampling_target_only``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specflow.registry import VERIFIERS
from specflow.runtime.transfer import to_device
from specflow.sampling import SamplingBatch, sample_rows, target_probs
from specflow.tree import DraftTree, Verdict
from verifiers.walk import accept_path, bonus_draws, draft_token_probs


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

    Every node's coin and scan sum are computed at once and the walk runs on the device
    (``walk.accept_path``): a coin drawn for a node off the path is never read.
    """

    def __init__(self, threshold_single: float = 1.0, threshold_acc: float = 1.0):
        if not 0.0 < threshold_single <= 1.0:
            raise ValueError(f"threshold verifier: threshold_single must be in (0, 1], got {threshold_single}")
        if not 0.0 <= threshold_acc <= 1.0:
            raise ValueError(f"threshold verifier: threshold_acc must be in [0, 1], got {threshold_acc}")
        self.threshold_single = threshold_single
        self.threshold_acc = max(threshold_acc, 1e-9)  # as SGLang: no division by zero

    @property
    def lossless(self) -> bool:
        """lossless at threshold_single = threshold_acc = 1.0, lossy below"""
        return self.threshold_single == 1.0 and self.threshold_acc == 1.0

    @classmethod
    def from_config(cls, cfg: ThresholdConfig, **_) -> "ThresholdVerifier":
        return cls(threshold_single=cfg.threshold_single, threshold_acc=cfg.threshold_acc)

    def verify(self, tree: DraftTree, target_logits: Tensor, sampling: SamplingBatch) -> Verdict:
        probs = target_probs(target_logits, sampling)  # [B, N, V], greedy rows one-hot
        (b, n, v), dev = probs.shape, probs.device
        sampling = sampling.coin_walk()
        tokens, parents, valid = to_device([tree.tokens, tree.parents.clamp(min=0), tree.valid], dev)
        idx = torch.arange(n, device=dev)
        u = sampling.coins(n, dev)  # [B, N]: a coin at every node
        # siblings[b, i, j]: j is a real child under i's parent, at or before i (i's scan so far)
        siblings = (valid & (idx > 0))[:, None, :] & (parents[:, None, :] == parents[:, :, None]) & (idx <= idx[:, None])
        repeat = (siblings & (tokens[:, None, :] == tokens[:, :, None]) & (idx < idx[:, None])).any(-1)  # [B, N]
        px = draft_token_probs(probs, tree).double().masked_fill(repeat, 0.0)  # [B, N] p(x), 0 once zeroed
        prob_acc = (siblings * px[:, None, :]).sum(-1)                        # [B, N] summed over the scan
        # '<' (not '<=') so a draft with p(x) = 0 never passes on a zero coin
        passes = (u.gather(1, parents) < prob_acc / self.threshold_acc) | (px >= self.threshold_single)
        accepted, accept_len, last = accept_path(tree, passes)
        # every child of the last node was rejected: the bonus comes from p without their tokens
        last = last.to(dev)
        rows = probs[torch.arange(b, device=dev), last]                       # [B, V]
        kids = valid & (idx > 0) & (parents == last[:, None])                # [B, N]
        cut = rows.new_zeros(b, v + 1).scatter_(1, torch.where(kids, tokens, v), 1.0)[:, :v] > 0  # [B, V]
        left = rows.masked_fill(cut, 0.0)
        rows = torch.where(left.sum(-1, keepdim=True) > 0, left, rows)        # no mass left: p itself
        return Verdict(accepted, accept_len, sample_rows(rows, bonus_draws(tree, accept_len, sampling, dev)))
