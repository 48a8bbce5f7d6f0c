"""Engine-like steps for drafters with their own model: build a tree, check every node's score
against a reference computed without tree attention, accept a path, commit, repeat. Also the
data and the contiguous EAGLE reference shared by the head drafters' tests."""

from __future__ import annotations

from typing import Callable

import torch

from specflow.protocols import Drafter, TargetFeatures
from specflow.runtime.model_runner import ModelRunner
from specflow.tree import DraftTree, Expansion, Frontier, Roots, Verdict

CONTEXTS = [[5, 17, 99, 3, 42, 8, 1, 77, 23], [9, 31, 7, 120, 56]]
PROMPTS = [[5, 17, 99, 3, 42, 8, 1, 77, 23], [9, 31, 7, 120, 56], [200, 4, 4, 4, 13, 250, 11, 2, 90]]
TREES = {"chain": {"type": "chain", "depth": 3},
         "static": {"type": "static", "choices": [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]},
         "eagle2": {"type": "eagle2", "topk": 3, "depth": 3, "num_draft_tokens": 8}}

# path_logprob(b, context, path) -> sum of log q(path[i] | context + path[:i]) over the path
PathLogprob = Callable[[int, list[int], list[int]], float]
# features(b, positions) -> [n, F] target features of request b's tokens at those positions
Features = Callable[[int, torch.Tensor], torch.Tensor]


def roots_for(contexts: list[list[int]]) -> Roots:
    return Roots(list(range(len(contexts))), torch.tensor([c[-1] for c in contexts]),
                 torch.tensor([len(c) - 1 for c in contexts]), contexts)


def target_features(drafter: Drafter, rids: list[int], tokens: list[list[int]], starts: list[int],
                    next_tokens: list[int], features: Features | None) -> TargetFeatures:
    """TargetFeatures of committed ``tokens`` (request r's first at position ``starts[r]``)."""
    positions = [torch.arange(s, s + len(t)) for s, t in zip(starts, tokens)]
    feats = None if features is None else [features(b, p) for b, p in zip(rids, positions)]
    return TargetFeatures(rids, [torch.tensor(t) for t in tokens], positions, next_tokens,
                          hidden=feats if drafter.needs.last_hidden else None,
                          taps=feats if drafter.needs.layer_taps else None)


def check_steps(drafter: Drafter, builder, contexts: list[list[int]], path_logprob: PathLogprob | None,
                features: Features | None = None, steps: int = 3) -> list[DraftTree]:
    """``steps`` builds; each commits the first-child path (depth <= step + 1) and a bonus token.
    Returns the trees (``path_logprob=None``: build and commit without checking scores)."""
    contexts = [list(c) for c in contexts]
    trees = []
    rids = list(range(len(contexts)))
    drafter.begin(target_features(drafter, rids, [c[:-1] for c in contexts], [0] * len(contexts),
                                  [c[-1] for c in contexts], features))
    for step in range(steps):  # several steps: commits must keep the drafter's state in sync
        tree = builder.build(drafter, roots_for(contexts))
        tree.check()
        trees.append(tree)
        for b, ctx in enumerate(contexts if path_logprob else []):
            for i in range(1, tree.num_nodes):
                if not tree.valid[b, i]:
                    continue
                path = tree.tokens[b, tree.path_to(b, i)[1:]].tolist()
                torch.testing.assert_close(float(tree.scores[b, i].log()), path_logprob(b, ctx, path),
                                           atol=1e-4, rtol=1e-4)
        accepted = []
        for b in rids:
            node, path = 0, [0]
            while len(path) <= step + 1:
                kids = [j for j in range(tree.num_nodes) if tree.parents[b, j] == node and tree.valid[b, j]]
                if not kids:
                    break
                node = kids[0]
                path.append(node)
            accepted.append(path)
        tokens = [tree.tokens[b, acc].tolist() for b, acc in enumerate(accepted)]
        bonus = [7 + 4 * b + step for b in rids]
        padded = torch.full((len(rids), 8), -1)
        for b, acc in enumerate(accepted):
            padded[b, : len(acc)] = torch.tensor(acc)
        verdict = Verdict(padded, torch.tensor([len(a) - 1 for a in accepted]), torch.tensor(bonus))
        starts = [len(c) - 1 for c in contexts]
        contexts = [c + t[1:] + [x] for c, t, x in zip(contexts, tokens, bonus)]
        drafter.commit(verdict, target_features(drafter, rids, tokens, starts, bonus, features))
    drafter.release(rids)
    return trees


class LevelByLevel:
    """A drafter seen without its ``beam``: an EAGLE-2 builder expands it level by level, with
    tree masks (the reference the beam must reproduce)."""

    def __init__(self, drafter: Drafter):
        self.drafter, self.needs = drafter, drafter.needs

    def begin(self, features: TargetFeatures) -> None:
        self.drafter.begin(features)

    def expand(self, frontier: Frontier) -> Expansion:
        return self.drafter.expand(frontier)

    def commit(self, verdict: Verdict, features: TargetFeatures) -> None:
        self.drafter.commit(verdict, features)

    def release(self, request_ids: list[int]) -> None:
        self.drafter.release(request_ids)


def feature_table(dim: int, seed: int = 0) -> Features:
    """Fixed random target features per (request, position)."""
    table = torch.randn(2, 64, dim, generator=torch.Generator().manual_seed(seed))
    return lambda b, positions: table[b, positions]


def contiguous_path_logprob(head, features: Features) -> PathLogprob:
    """log q of a path run without tree attention, as cnets1 ``topK_genrate`` aligns it: the
    context's tokens x_1..x_root paired with the target features of x_0..x_{root-1} at positions
    0..root-1, then each path token paired with the head's previous output."""

    @torch.inference_mode()
    def path_logprob(b, ctx, path):
        runner = ModelRunner(head, num_pages=256)
        out = runner.extend([0], [ctx[1:]], logits="none",
                            inputs={"features": features(b, torch.arange(len(ctx) - 1))}).hidden[-1]
        total = 0.0
        for tok in path:
            draft = torch.log_softmax(head.compute_logits(out).float(), -1)  # [V_draft]
            ids = head.draft_to_target(torch.arange(len(draft)))
            total += float(torch.full((head.config.vocab_size,), float("-inf")).index_copy_(0, ids, draft)[tok])
            out = runner.extend([0], [[tok]], logits="none", inputs={"features": out[None]}).hidden[-1]
        return total

    return path_logprob
