"""What the verifiers' tree walks share: the walk that takes the first passing child at each depth,
vectorised over depth on the device, each node's first child and next sibling (for a walk that
tries siblings in turn), the target probability of each draft token, and the uniform a bonus
token is drawn with."""

from __future__ import annotations

import torch
from torch import Tensor

from specflow.runtime.transfer import to_device
from specflow.sampling import SamplingBatch, sample_rows, target_probs
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
    passes = passes.to(idx.device) & tree.valid & (idx > 0)                                  # [B, N]
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


def exact_match(tree: DraftTree, target_logits: Tensor, sampling: SamplingBatch) -> Verdict:
    """Accept a child iff its token is the target's own token at its parent: the argmax for
    greedy rows, else a draw from the processed distribution there, followed through the tree
    (``follow``). Each committed token is then a fresh draw from the target given the tokens
    before it: lossless at any temperature, whatever the drafts, and for top-k (point-mass)
    drafts exactly rejection sampling. A node draws with the uniform of the position its child
    would take (``SamplingBatch.draws``), the one plain decoding draws that token with: with the
    same seed the output is plain decoding's, token for token."""
    if bool(sampling.greedy.all()):
        # temperature, top-k, top-p and min-p all keep the most likely token, so the argmax of the
        # raw logits is the argmax of the processed probs (target_probs): no need to process
        return follow(tree, target_logits.argmax(-1))                                    # [B, N] argmax
    probs = target_probs(target_logits, sampling)                                       # [B, N, V], greedy rows one-hot
    depth = tree.depth.to(probs.device)
    return follow(tree, sample_rows(probs, sampling.draws(tree.depth_bound(), probs.device).gather(1, depth)))


def bonus_draws(tree: DraftTree, accept_len: Tensor, sampling: SamplingBatch, device: torch.device) -> Tensor:
    """[B] float64 on ``device``: the uniform each request's bonus token is drawn with, that of the
    position it takes (depth ``accept_len`` + 1: ``draws(depth_bound)[:, accept_len]``), as plain
    decoding draws that token."""
    return sampling.draws(tree.depth_bound(), device).gather(1, accept_len.to(device).view(-1, 1))[:, 0]


def draft_token_probs(probs: Tensor, tree: DraftTree) -> Tensor:
    """p(token of node i | path to its parent): ``probs[b, parents[b, i], tokens[b, i]]``, [B, N]
    where probs lie."""
    b, n, v = probs.shape
    parents, tokens = to_device([tree.parents, tree.tokens], probs.device)
    return probs.reshape(b, n * v).gather(1, parents.clamp(min=0) * v + tokens)


def first_child_next_sibling(parents: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """[B, N] parents and valid -> ``first_child[b, i]`` and ``next_sibling[b, i]`` ([B, N], -1
    for none): a node's valid children in index order."""
    n = parents.shape[1]
    idx = torch.arange(n, device=parents.device)
    child = valid & (idx >= 1)                                                   # [B, N] valid non-roots
    # is_child[b, i, j]: j is a valid child of i; later[b, i, j]: j is a valid sibling of valid i after it
    is_child = child[:, None, :] & (parents[:, None, :] == idx[None, :, None])   # [B, N, N]
    later = (child[:, None, :] & child[:, :, None] & (parents[:, None, :] == parents[:, :, None])
             & (idx[None, None, :] > idx[None, :, None]))                        # [B, N, N]
    return (torch.where(is_child.any(-1), is_child.byte().argmax(-1), -1),       # argmax: the first True
            torch.where(later.any(-1), later.byte().argmax(-1), -1))
