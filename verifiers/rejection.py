"""Lossless tree rejection sampling: one rule for chains and trees, sampled or top-k drafts."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from specflow.registry import VERIFIERS
from specflow.runtime.transfer import to_device, to_host
from specflow.sampling import SamplingBatch, sample_rows, target_probs, uniform, uniforms
from specflow.tree import DraftTree, Verdict
from verifiers.walk import HostTree, Residual, draft_token_probs, follow, make_verdict, sample_bonus


@dataclass
class RejectionConfig:
    pass


@VERIFIERS.register("rejection", config=RejectionConfig)
class RejectionVerifier:
    """Speculative sampling over the tree: the committed tokens follow the target exactly.

    At the current node, with residual target p (the processed probs there), try its children
    in index order. Child x was proposed from q_x: the drafter's q at the parent when it was
    sampled (``tree.sampled``), else the point mass at x (a top-k pick: EAGLE / SGLang
    "target-only"). Then
      accept x   with probability min(1, p(x) / q_x(x))          (u * q_x(x) < p(x))
      reject x:  p <- norm(max(0, p - q_x)),
                 and for a sampled x (drawn without replacement): q(x) <- 0, q <- norm(q)
    and on acceptance continue at x with its own p and q. When every child is rejected (or
    the node is a leaf) the bonus token is sampled from the residual p. For a sampled chain
    this is Leviathan et al.; for sampled siblings, Sequoia's rule; for top-k siblings the
    point-mass residual is p with the rejected tokens removed.

    When every draft is a top-k pick (no ``draft_probs``) the rule is simpler than it reads:
    trying point masses in order accepts child x exactly when a draw y ~ p at the node equals x
    (the first such child), and the residual then left is the law of y given that no child
    matched. So one target token is drawn at every node, on the device, and the walk follows
    them (``walk.follow``) with nothing read back. Sampled drafts walk on the host, one depth
    at a time over all requests: the p and q rows their children need come in one copy per depth.
    """

    lossless = True

    @classmethod
    def from_config(cls, cfg: RejectionConfig, **_) -> "RejectionVerifier":
        return cls()

    def verify(self, tree: DraftTree, target_logits: Tensor, sampling: SamplingBatch) -> Verdict:
        if bool(sampling.greedy.all()):  # p one-hot everywhere: every rule above takes the argmax
            return follow(tree, target_logits.argmax(-1))
        probs = target_probs(target_logits, sampling)  # [B, N, V], greedy rows one-hot
        if tree.draft_probs is None:  # top-k picks only: a draw at every node, followed
            return follow(tree, sample_rows(probs, uniforms(sampling.generators, tree.num_nodes, probs.device)))
        host = HostTree.of(tree, draft_token_probs(probs, tree))  # values: p(x) at x's parent
        b = tree.batch_size
        paths = [[0] for _ in range(b)]
        residuals: list[Residual | None] = [None] * b
        active = list(range(b))
        while active:
            dense = [r for r in active if any(host.sampled[r][c] for c in host.children(r, paths[r][-1]))]
            rows = self._host_rows(probs, tree, dense, [paths[r][-1] for r in dense])
            still = []
            for r in active:
                child, res = self._try_children(host, r, paths[r][-1], rows.get(r), sampling.generators[r])
                if child is None:
                    residuals[r] = res
                else:
                    paths[r].append(child)
                    still.append(r)
            active = still
        bonus = sample_bonus(probs, residuals, sampling.generators)
        return make_verdict(paths, bonus, host.max_depth)

    @staticmethod
    def _host_rows(probs: Tensor, tree: DraftTree, reqs: list[int], nodes: list[int]) -> dict[int, np.ndarray]:
        """{request: [2, V] float64 (p, q) at its node}, each row indexed where it lies and
        brought to the host in one copy."""
        if not reqs:
            return {}
        assert tree.draft_probs is not None, "sampled nodes need tree.draft_probs"
        r, n = torch.tensor(reqs), torch.tensor(nodes)
        p_r, p_n = to_device([r, n], probs.device)
        q_r, q_n = to_device([r, n], tree.draft_probs.device)
        p_rows, q_rows = to_host([probs[p_r, p_n], tree.draft_probs[q_r, q_n].to(probs.dtype)])  # [R, V] each
        return dict(zip(reqs, np.stack([p_rows.double().numpy(), q_rows.double().numpy()], 1)))  # [R, 2, V]

    @staticmethod
    def _try_children(host: HostTree, b: int, node: int, pq: np.ndarray | None,
                      g: torch.Generator) -> tuple[int | None, Residual]:
        """Run the rule over the children of ``node``: the accepted child (or None) and the residual."""
        res = Residual(node)
        rest = 1.0          # lazy residual (point masses only): p without res.zeroed, over `rest`
        p = q = None        # dense residual and q, once a sampled child is tried
        for c in host.children(b, node):
            x, u = host.tokens[b][c], uniform(g)
            if host.sampled[b][c]:
                if q is None:  # the processed p sums to 1 unless point masses were rejected
                    p, q = pq[0].copy(), pq[1].copy()
                    if res.zeroed:
                        p[res.zeroed] = 0.0
                        p = _normalised(p, pq[0])
                # accept with prob min(1, p(x) / q(x)); '<' so that p(x) = 0 never passes
                if u * q[x] < p[x]:
                    return c, res
                p = _normalised(np.maximum(p - q, 0.0), pq[0])
                q[x] = 0.0  # drawn without replacement: x cannot come again
                q = _normalised(q, q)
            elif p is not None:
                # point mass at x on the dense residual: accept with prob p(x), else p loses x
                if u < p[x]:
                    return c, res
                p[x] = 0.0
                p = _normalised(p, pq[0])
            else:
                # the same on the lazy residual: p(x) / rest unless x is already out
                px = 0.0 if x in res.zeroed else host.values[b][c]
                if u * rest < px:
                    return c, res
                if x not in res.zeroed:
                    res.zeroed.append(x)
                    rest -= px
                    if rest <= 0.0:  # nothing left (rounding): fall back to p
                        res.zeroed, rest = [], 1.0
        if p is not None:
            res.dense = torch.from_numpy(p)
        return None, res


def _normalised(x: np.ndarray, fallback: np.ndarray) -> np.ndarray:
    """x / sum(x); when x has no mass left, ``fallback`` (normalised if it has mass)."""
    total = x.sum()
    if total > 0.0:
        return x / total
    total = fallback.sum()
    return fallback / total if total > 0.0 else fallback
