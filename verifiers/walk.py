"""What every verifier's per-request tree walk shares: the tree on the host, the target probability
of each draft token, the residual left at the last accepted node, and the Verdict."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import Tensor

from specflow.sampling import sample_rows, uniforms
from specflow.tree import DraftTree, Verdict


@dataclass
class HostTree:
    """A DraftTree's small per-node arrays as Python lists (copied to the host once)."""

    tokens: list[list[int]]
    sampled: list[list[bool]]
    first_child: list[list[int]]
    next_sibling: list[list[int]]
    max_depth: int

    @staticmethod
    def of(tree: DraftTree) -> "HostTree":
        small = torch.stack([tree.tokens, tree.sampled.long(), tree.depth]).cpu()  # [3, B, N]
        first_child, next_sibling = tree.first_child_next_sibling()
        return HostTree(small[0].tolist(), small[1].bool().tolist(), first_child.tolist(),
                        next_sibling.tolist(), int(small[2].max()) if small.numel() else 0)

    def children(self, b: int, node: int) -> Iterator[int]:
        """Valid children of ``node`` in request b, in index order."""
        child = self.first_child[b][node]
        while child != -1:
            yield child
            child = self.next_sibling[b][child]


def draft_token_probs(probs: Tensor, tree: DraftTree) -> list[list[float]]:
    """p(token of node i | path to its parent): ``probs[b, parents[b, i], tokens[b, i]]``, [B, N] on the host."""
    b, n, v = probs.shape
    flat = tree.parents.clamp(min=0) * v + tree.tokens  # [B, N] index into [N * V]
    return probs.reshape(b, n * v).gather(1, flat).cpu().tolist()


@dataclass
class Residual:
    """The target distribution left at the last accepted node ``node`` of one request:
    ``probs[b, node]`` without the ``zeroed`` tokens (target-only rejections), or, after a
    rejection of a sampled draft, the explicit host vector ``dense`` [V]."""

    node: int
    zeroed: list[int] = field(default_factory=list)
    dense: Tensor | None = None


def sample_bonus(probs: Tensor, residuals: list[Residual], generators: list[torch.Generator]) -> list[int]:
    """One bonus token per request from its renormalised residual.

    Every row is sampled at once (``sample_rows``) with one uniform per request; only the tokens
    come back to the host. A residual with no mass left (rounding, or every token zeroed)
    falls back to the node's full distribution.
    """
    b, n, v = probs.shape
    dev = probs.device
    nodes = torch.tensor([r.node for r in residuals], device=dev)
    rows = probs[torch.arange(b, device=dev), nodes].double()  # [B, V]
    cut = [(i, t) for i, r in enumerate(residuals) for t in r.zeroed]
    if cut:
        bi, ti = torch.tensor(cut, device=dev).T
        left = rows.index_put((bi, ti), rows.new_zeros(len(cut)))
        rows = torch.where(left.sum(-1, keepdim=True) > 0, left, rows)
    dense = [i for i, r in enumerate(residuals) if r.dense is not None]
    if dense:
        rows[dense] = torch.stack([residuals[i].dense for i in dense]).to(rows)
    return sample_rows(rows, uniforms(generators, dev)).tolist()


def make_verdict(paths: list[list[int]], bonus: list[int], max_depth: int) -> Verdict:
    """Accepted node paths (root first) and bonus tokens -> Verdict with accepted [B, max_depth + 1],
    on the host (where the walk ran and the engine reads it)."""
    padded = [p + [-1] * (max_depth + 1 - len(p)) for p in paths]
    return Verdict(
        accepted=torch.tensor(padded, dtype=torch.long),
        accept_len=torch.tensor([len(p) - 1 for p in paths], dtype=torch.long),
        bonus_tokens=torch.tensor(bonus, dtype=torch.long),
    )
