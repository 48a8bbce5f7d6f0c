"""Lossless tree rejection sampling: one rule for chains and trees, sampled or top-k drafts."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specflow.registry import VERIFIERS
from specflow.runtime.transfer import to_device
from specflow.sampling import SamplingBatch, sample_rows, target_probs
from specflow.tree import DraftTree, Verdict
from verifiers.walk import exact_match, first_child_next_sibling


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
    matched. So one target token is drawn at every node and the walk follows them
    (``walk.exact_match``). With sampled drafts the rule runs as written, one child per request per
    iteration (``_walk``). Both run on the device with nothing read back. Uniforms: a top-k
    node's draw is the one of the position it fills (``SamplingBatch.draws``); a sampled child's
    coin is the step's coin for that node (``SamplingBatch.coins``), and the bonus the draw of
    its position, both of ``SamplingBatch.coin_walk``.
    """

    lossless = True

    @classmethod
    def from_config(cls, cfg: RejectionConfig, **_) -> "RejectionVerifier":
        return cls()

    def verify(self, tree: DraftTree, target_logits: Tensor, sampling: SamplingBatch) -> Verdict:
        # top-k picks only (a draw at every node, followed), or p one-hot everywhere (every rule
        # above takes the argmax)
        if tree.draft_probs is None or bool(sampling.greedy.all()):
            return exact_match(tree, target_logits, sampling)
        probs = target_probs(target_logits, sampling)  # [B, N, V], greedy rows one-hot
        walk = sampling.coin_walk()
        return self._walk(tree, probs, walk.coins(tree.num_nodes, probs.device),
                          walk.draws(tree.depth_bound(), probs.device))

    @staticmethod
    def _walk(tree: DraftTree, probs: Tensor, u: Tensor, draws: Tensor) -> Verdict:
        """The rule over ``probs`` [B, N, V] with coin ``u[b, x]`` for child x, and ``draws[b, d]``
        [B, D + 1] for a bonus after depth d. Each iteration every request tries one child: the
        first child of the node it just accepted, or the next sibling of the child it just
        rejected. A child is tried at most once, so N - 1 iterations finish every walk, or
        ``tree.max_tries`` of them."""
        (b, n, _), dev = probs.shape, probs.device
        # (one copy of what lies on the host, no wait; a host drafter's q [B, N, V] with it)
        tokens, parents, valid, sampled, depth, draft = to_device(
            [tree.tokens, tree.parents, tree.valid, tree.sampled, tree.depth, tree.draft_probs], dev)
        first_child, next_sibling = first_child_next_sibling(parents, valid)     # [B, N] each
        rows = torch.arange(b, device=dev)
        node = torch.zeros(b, dtype=torch.long, device=dev)                       # [B] last accepted node
        child = first_child[:, 0]                                                 # [B] to try next, -1: done
        p = full = probs[:, 0].double()                                           # [B, V] residual, and p itself
        q = _law(draft[:, 0])                                                     # [B, V]
        d = tree.depth_bound()
        path = torch.full((b, d + 2), -1, dtype=torch.long, device=dev)           # [B, D + 2] by depth; D + 1: a sink
        path[:, 0] = 0
        for _ in range(n - 1 if tree.max_tries is None else min(tree.max_tries, n - 1)):
            c = child.clamp(min=0)
            x, coin, drawn = tokens[rows, c], u[rows, c], sampled[rows, c]       # [B] each
            px, qx = p[rows, x], q[rows, x]
            # '<' so that p(x) = 0 never passes; a point mass has q_x(x) = 1
            take = (child >= 0) & (coin * torch.where(drawn, qx, 1.0) < px)
            drop = (child >= 0) & ~take
            less = torch.where(drawn[:, None], (p - q).clamp(min=0.0), p.scatter(1, x[:, None], 0.0))
            p = torch.where(drop[:, None], _normalised(less, full), p)
            without = q.scatter(1, x[:, None], 0.0)  # drawn without replacement: x cannot come again
            q = torch.where((drop & drawn)[:, None], _normalised(without, without), q)
            full = torch.where(take[:, None], probs[rows, c].double(), full)     # on acceptance: x's own p, q
            p = torch.where(take[:, None], full, p)
            q = torch.where(take[:, None], _law(draft[rows, c]), q)
            path.scatter_(1, torch.where(take, depth[rows, c], d + 1)[:, None], c[:, None])
            node = torch.where(take, c, node)
            child = torch.where(take, first_child[rows, c], torch.where(drop, next_sibling[rows, c], child))
        accept_len = depth[rows, node]                                            # [B]
        return Verdict(path[:, : d + 1], accept_len, sample_rows(p, draws[rows, accept_len]))


def _law(q: Tensor) -> Tensor:
    """A node's q [B, V] as the law its children were drawn from, in float64: a row that does not
    sum to 1 is read as its normalised law (as GrowingTree draws it; a builder of its own may
    record the drafter's q as given, which the drafter contract lets sum to anything); a row
    without mass stays 0."""
    q = q.double()
    return _normalised(q, q)


def _normalised(x: Tensor, fallback: Tensor) -> Tensor:
    """Rows of x [B, V] over their sums; a row without mass is ``fallback``'s."""
    total = x.sum(-1, keepdim=True)
    return torch.where(total > 0, x / total.clamp(min=1e-300), fallback)
