"""What the verifiers' tree walks share: the walk on the device that takes the first passing child
at each depth (every verifier but sampled rejection), and for the host walk of sampled drafts the
tree on the host, the residual left at the last accepted node and the Verdict; the target
probability of each draft token serves both."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import torch
from torch import Tensor

from specflow.runtime.transfer import to_device, to_host
from specflow.sampling import sample_rows, uniform
from specflow.tree import DraftTree, Verdict, ancestor_mask


def accept_path(tree: DraftTree, passes: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The walk from the root that takes, at each depth, the first child (in index order) that
    passes its test, until none does; vectorised over depth, nothing read back.

    ``passes`` [B, N] bool: node i passes at its parent (ignored at the root and padding).
    Returns ``accepted`` [B, D + 1] (root first, -1 padded), ``accept_len`` [B] and the last
    accepted node ``last`` [B], where the tree lies (D: ``tree.depth_bound()``).
    """
    (b, n), depth = tree.tokens.shape, tree.depth_bound()
    idx = torch.arange(n, device=tree.tokens.device)
    parents = tree.parents.clamp(min=0)
    # a node is taken when it passes and no earlier sibling does; the walk is every node whose
    # ancestors (and itself) are taken
    passes = passes & tree.valid & (idx > 0)                                                 # [B, N]
    earlier = passes[:, None, :] & (parents[:, None, :] == parents[:, :, None]) & (idx < idx[:, None])  # [B, N, N]
    taken = (passes & ~earlier.any(-1)) | (idx == 0)                                         # [B, N]
    mask = tree.mask if tree.mask is not None else ancestor_mask(tree.parents, depth)       # [B, N, N]
    on_path = ~(mask & ~taken[:, None, :]).any(-1)                                           # [B, N]
    # at most one taken child under each node: the path has one node per depth
    slot = torch.where(on_path, tree.depth, depth + 1)                                       # [B, N]
    accepted = torch.full((b, depth + 2), -1, dtype=torch.long, device=idx.device)
    accepted = accepted.scatter_(1, slot, idx.expand(b, n))[:, : depth + 1]                  # [B, D + 1]
    accept_len = on_path.sum(1) - 1                                                          # [B]
    return accepted, accept_len, accepted.gather(1, accept_len[:, None])[:, 0]


def follow(tree: DraftTree, targets: Tensor) -> Verdict:
    """The verdict when the target's token at every node is known, ``targets`` [B, N] (its
    argmax, or a draw from it): accept a child iff its token is the target's at its parent; the
    bonus is the target's token at the last accepted node."""
    targets = targets.to(tree.tokens.device)
    accepted, accept_len, last = accept_path(tree, tree.tokens == targets.gather(1, tree.parents.clamp(min=0)))
    return Verdict(accepted, accept_len, targets.gather(1, last[:, None])[:, 0])


@dataclass
class HostTree:
    """A DraftTree's small per-node arrays as Python lists, with one [B, N] per-node value a
    verifier computed beside it (all copied to the host at once)."""

    tokens: list[list[int]]
    sampled: list[list[bool]]
    first_child: list[list[int]]
    next_sibling: list[list[int]]
    values: list[list]
    max_depth: int

    @staticmethod
    def of(tree: DraftTree, values: Tensor) -> "HostTree":
        """``tree`` and ``values`` [B, N] (e.g. ``draft_token_probs``) on the host, in one copy."""
        tokens, sampled, parents, valid, values = (t.numpy() for t in to_host(
            [tree.tokens, tree.sampled, tree.parents, tree.valid, values]))
        first_child, next_sibling = first_child_next_sibling(parents, valid)
        return HostTree(tokens.tolist(), sampled.tolist(), first_child.tolist(), next_sibling.tolist(),
                        values.tolist(), tree.depth_bound())

    def children(self, b: int, node: int) -> Iterator[int]:
        """Valid children of ``node`` in request b, in index order."""
        child = self.first_child[b][node]
        while child != -1:
            yield child
            child = self.next_sibling[b][child]


def first_child_next_sibling(parents: np.ndarray, valid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[B, N] parents and valid -> ``first_child[b, i]`` and ``next_sibling[b, i]`` ([B, N], -1
    for none): a node's valid children in index order."""
    n = parents.shape[1]
    idx = np.arange(n)
    child = valid & (idx >= 1)                                                   # [B, N] valid non-roots
    # is_child[b, i, j]: j is a valid child of i; later[b, i, j]: j is a valid sibling of valid i after it
    is_child = child[:, None, :] & (parents[:, None, :] == idx[None, :, None])   # [B, N, N]
    later = (child[:, None, :] & child[:, :, None] & (parents[:, None, :] == parents[:, :, None])
             & (idx[None, None, :] > idx[None, :, None]))                        # [B, N, N]
    return (np.where(is_child.any(-1), is_child.argmax(-1), -1),                 # argmax: the first True
            np.where(later.any(-1), later.argmax(-1), -1))


def draft_token_probs(probs: Tensor, tree: DraftTree) -> Tensor:
    """p(token of node i | path to its parent): ``probs[b, parents[b, i], tokens[b, i]]``, [B, N]
    where probs lie."""
    b, n, v = probs.shape
    parents, tokens = to_device([tree.parents, tree.tokens], probs.device)
    return probs.reshape(b, n * v).gather(1, parents.clamp(min=0) * v + tokens)


@dataclass
class Residual:
    """The target distribution left at the last accepted node ``node`` of one request:
    ``probs[b, node]`` without the ``zeroed`` tokens (target-only rejections), or, after a
    rejection of a sampled draft, the explicit host vector ``dense`` [V]."""

    node: int
    zeroed: list[int] = field(default_factory=list)
    dense: Tensor | None = None


def sample_bonus(probs: Tensor, residuals: list[Residual], generators: list[torch.Generator]) -> Tensor:
    """One bonus token per request from its renormalised residual, [B] where probs lie (the
    engine brings them back with the rest of the verdict: no wait here).

    Every row is sampled at once (``sample_rows``) with one uniform per request. A residual
    with no mass left (rounding, or every token zeroed) falls back to the node's full distribution.
    """
    b = probs.shape[0]
    cut = torch.tensor([(i, t) for i, r in enumerate(residuals) for t in r.zeroed], dtype=torch.long).view(-1, 2)
    dense = [i for i, r in enumerate(residuals) if r.dense is not None]
    host = [torch.tensor([r.node for r in residuals]), cut, torch.tensor(dense, dtype=torch.long),
            torch.tensor([uniform(g) for g in generators], dtype=torch.float64)]
    if dense:
        host.append(torch.stack([residuals[i].dense for i in dense]).double())  # [R, V]
    nodes, cut, dense, u, *dense_rows = to_device(host, probs.device)  # one copy, no wait
    rows = probs[torch.arange(b, device=probs.device), nodes].double()   # [B, V]
    if len(cut):
        left = rows.index_put((cut[:, 0], cut[:, 1]), rows.new_zeros(len(cut)))
        rows = torch.where(left.sum(-1, keepdim=True) > 0, left, rows)
    if dense_rows:
        rows = rows.index_copy(0, dense, dense_rows[0])
    return sample_rows(rows, u)


def make_verdict(paths: list[list[int]], bonus: Tensor, max_depth: int) -> Verdict:
    """Accepted node paths (root first) and bonus tokens [B] -> Verdict with accepted
    [B, max_depth + 1] on the host (where the walk ran) and the bonus tokens where they are."""
    padded = [p + [-1] * (max_depth + 1 - len(p)) for p in paths]
    return Verdict(
        accepted=torch.tensor(padded, dtype=torch.long),
        accept_len=torch.tensor([len(p) - 1 for p in paths], dtype=torch.long),
        bonus_tokens=bonus,
    )
