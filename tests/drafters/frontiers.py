"""Hand-built frontiers for drafter tests (no tree builder involved)."""

import torch

from specflow.tree import DraftTree, Frontier, Roots


def chain_frontier(contexts: list[list[int]], paths: list[list[int]], k: int,
                   want_probs: bool = False) -> Frontier:
    """A chain root -> path[0] -> ... per request (paths of equal length), every node in the frontier."""
    b, n = len(contexts), len(paths[0]) + 1
    tokens = torch.tensor([[ctx[-1]] + path for ctx, path in zip(contexts, paths)])  # [B, N]
    depth = torch.arange(n).expand(b, n)
    root_pos = torch.tensor([len(ctx) - 1 for ctx in contexts])
    tree = DraftTree(tokens=tokens, parents=(depth - 1).clone(), depth=depth.clone(),
                     positions=root_pos[:, None] + depth, scores=torch.ones(b, n),
                     valid=torch.ones(b, n, dtype=torch.bool), sampled=torch.zeros(b, n, dtype=torch.bool))
    roots = Roots(request_ids=list(range(b)), tokens=tokens[:, 0], positions=root_pos, contexts=contexts)
    return Frontier(roots=roots, tree=tree, nodes=depth.clone(), k=k, want_probs=want_probs)
