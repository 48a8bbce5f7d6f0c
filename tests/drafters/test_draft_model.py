"""draft_model expands trees with tree attention over its own paged KV: every node's draft
log-probability equals the draft model run contiguously over the node's whole path."""

import pytest
import torch

from drafters.draft_model import DraftModelDrafter
from specflow.models import load_model
from specflow.protocols import TargetFeatures
from specflow.runtime.model_runner import ModelRunner
from specflow.tree import Roots, Verdict
from trees.chain import ChainBuilder
from trees.eagle2 import Eagle2Builder
from trees.static import StaticBuilder

CONTEXTS = [[5, 17, 99, 3, 42, 8, 1, 77, 23], [9, 31, 7, 120, 56]]


def reference_logprobs(model, context: list[int]) -> torch.Tensor:
    """[V] next-token log-probs of the draft model over a fresh contiguous cache."""
    runner = ModelRunner(model, num_pages=512)
    return torch.log_softmax(runner.extend([0], [context], logits="last").logits[0].float(), -1)


def roots_for(contexts):
    return Roots(list(range(len(contexts))), torch.tensor([c[-1] for c in contexts]),
                 torch.tensor([len(c) - 1 for c in contexts]), contexts)


@pytest.mark.parametrize("builder", [ChainBuilder(depth=3), StaticBuilder(preset="mc_sim_7b_63"),
                                     Eagle2Builder(topk=3, depth=3, num_draft_tokens=10)],
                         ids=["chain", "static", "eagle2"])
def test_tree_scores_match_contiguous_draft_model(tiny_target, builder):
    model = load_model(tiny_target)
    drafter = DraftModelDrafter(model, page_size=4)
    contexts = [list(c) for c in CONTEXTS]
    drafter.begin(TargetFeatures([0, 1], [torch.tensor(c[:-1]) for c in contexts],
                                 [torch.arange(len(c) - 1) for c in contexts], [c[-1] for c in contexts]))
    for step in range(3):  # several steps: commits must keep the drafter's cache in sync
        tree = builder.build(drafter, roots_for(contexts))
        tree.check()
        for b, ctx in enumerate(contexts):
            for i in range(1, tree.num_nodes):
                if not tree.valid[b, i]:
                    continue
                path = tree.path_to(b, i)
                ref = 0.0
                for depth in range(1, len(path)):
                    prefix = ctx + tree.tokens[b, path[1:depth]].tolist()
                    ref += float(reference_logprobs(model, prefix)[tree.tokens[b, path[depth]]])
                torch.testing.assert_close(float(tree.scores[b, i].log()), ref, atol=1e-4, rtol=1e-4)
        # accept the deepest first-child path of each tree, plus a bonus token
        accepted = []
        for b in range(2):
            node, path = 0, [0]
            while True:
                kids = [j for j in range(tree.num_nodes) if tree.parents[b, j] == node and tree.valid[b, j]]
                if not kids or len(path) > step + 1:
                    break
                node = kids[0]
                path.append(node)
            accepted.append(path)
        tokens = [tree.tokens[b, acc].tolist() for b, acc in enumerate(accepted)]
        bonus = [7 + step, 11 + step]
        padded = torch.full((2, 8), -1)
        for b, acc in enumerate(accepted):
            padded[b, : len(acc)] = torch.tensor(acc)
        verdict = Verdict(padded, torch.tensor([len(a) - 1 for a in accepted]), torch.tensor(bonus))
        starts = [len(c) - 1 for c in contexts]
        contexts = [c + t[1:] + [x] for c, t, x in zip(contexts, tokens, bonus)]
        drafter.commit(verdict, TargetFeatures([0, 1], [torch.tensor(t) for t in tokens],
                                               [torch.arange(s, s + len(t)) for s, t in zip(starts, tokens)], bonus))
    drafter.release([0, 1])
    assert drafter.runner.runner.cache.num_pages_used == 0


def test_vocabulary_mismatch_is_rejected(tiny_target):
    from specflow.models import CheckpointError

    with pytest.raises(CheckpointError, match="vocabulary"):
        DraftModelDrafter(load_model(tiny_target), target_vocab_size=999)
