"""Medusa's typical acceptance: accept drafts the target finds plausible enough (lossy)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specflow.registry import VERIFIERS
from specflow.runtime.transfer import to_device
from specflow.sampling import SamplingBatch, next_tokens
from specflow.tree import DraftTree, Verdict
from verifiers.walk import accept_path, bonus_draws, draft_token_probs


@dataclass
class TypicalConfig:
    epsilon: float = 0.09  # hard probability floor (Medusa's posterior_threshold)
    delta: float = 0.3     # entropy-scaled floor, about sqrt(epsilon) (Medusa's posterior_alpha)


@VERIFIERS.register("typical", config=TypicalConfig)
class TypicalVerifier:
    """Accept a draft x when the target finds it typical, not when a coin says so:

      p = softmax(logits / T) at the parent (no top-k / top-p),  H = entropy of p
      accept x  iff  p(x) > min(epsilon, delta * exp(-H))

    taking the first passing child in index order at each depth. Temperature-0 requests walk
    greedily (accept iff x is the argmax). The bonus is sampled from the processed target
    distribution at the last accepted node. Lossy: the output is not the target's distribution.
    """

    lossless = False

    def __init__(self, epsilon: float = 0.09, delta: float = 0.3):
        if not 0.0 < epsilon < 1.0:
            raise ValueError(f"typical verifier: epsilon must be in (0, 1), got {epsilon}")
        if delta <= 0.0:
            raise ValueError(f"typical verifier: delta must be > 0, got {delta}")
        self.epsilon, self.delta = epsilon, delta

    @classmethod
    def from_config(cls, cfg: TypicalConfig, **_) -> "TypicalVerifier":
        return cls(epsilon=cfg.epsilon, delta=cfg.delta)

    def verify(self, tree: DraftTree, target_logits: Tensor, sampling: SamplingBatch) -> Verdict:
        logits = target_logits.float()
        b, n, v = logits.shape
        temp, greedy, parents, tokens = to_device(  # (one copy)
            [sampling.temperature, sampling.greedy, tree.parents.clamp(min=0), tree.tokens], logits.device)
        temp = temp.clamp(min=1e-5).view(b, 1, 1)
        p = torch.softmax(logits / temp, dim=-1)                                   # [B, N, V]
        floor = torch.clamp(self.delta * torch.exp(-torch.special.entr(p).sum(-1)), max=self.epsilon)  # [B, N]
        typical = draft_token_probs(p, tree) > floor.gather(1, parents)            # [B, N]
        is_argmax = tokens == logits.argmax(-1).gather(1, parents)
        accepted, accept_len, last = accept_path(tree, torch.where(greedy.view(b, 1), is_argmax, typical))
        # the bonus reads one row per request: process only those
        last_logits = logits[torch.arange(b, device=logits.device), last.to(logits.device)]  # [B, V]
        u = None if bool(sampling.greedy.all()) else bonus_draws(tree, accept_len, sampling, logits.device)  # (host)
        return Verdict(accepted, accept_len, next_tokens(last_logits, sampling, u))
