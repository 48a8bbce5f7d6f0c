"""At temperature 0 every verifier must commit exactly the target's greedy walk through the tree,
whatever its batch mates' temperatures."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specflow.config import build_component
from specflow.registry import VERIFIERS
from specflow.sampling import SamplingBatch, SamplingParams
from specflow.tree import DraftTree
from verifiers.greedy import GreedyVerifier

VOCAB = 3  # tiny, so that drafts often match the argmax


@st.composite
def random_trees(draw) -> DraftTree:
    """Random trees with padding, duplicate sibling tokens and mixed sampled / top-k nodes."""
    b, n = draw(st.integers(1, 3)), draw(st.integers(1, 8))
    tokens, parents, valid = torch.zeros(b, n, dtype=torch.long), torch.zeros(b, n, dtype=torch.long), \
        torch.zeros(b, n, dtype=torch.bool)
    parents[:, 0], valid[:, 0] = -1, True
    for r in range(b):
        tokens[r, 0] = draw(st.integers(0, VOCAB - 1))
        for i in range(1, n):
            if draw(st.integers(0, 4)) > 0:  # a real node under some earlier real node
                parents[r, i] = draw(st.sampled_from(valid[r, :i].nonzero()[:, 0].tolist()))
                tokens[r, i], valid[r, i] = draw(st.integers(0, VOCAB - 1)), True
    depth = torch.zeros(b, n, dtype=torch.long)
    for i in range(1, n):
        depth[:, i] = depth.gather(1, parents[:, i:i + 1])[:, 0] + 1
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    q = torch.rand(b, n, VOCAB, generator=g)
    sampled = (torch.rand(b, n, generator=g) < 0.5) & valid
    sampled[:, 0] = False
    tree = DraftTree(tokens, parents, depth, depth + 7, torch.ones(b, n), valid, sampled,
                     draft_probs=q / q.sum(-1, keepdim=True)).with_mask()
    tree.check()
    return tree


def greedy_walk(tree: DraftTree, logits: torch.Tensor) -> list[tuple[list[int], int]]:
    """Reference: from the root, follow the first valid child equal to the argmax; bonus = argmax."""
    out = []
    for b in range(tree.batch_size):
        node, path = 0, [0]
        while True:
            target = int(logits[b, node].argmax())
            kids = [i for i in range(1, tree.num_nodes)
                    if tree.valid[b, i] and tree.parents[b, i] == node and tree.tokens[b, i] == target]
            if not kids:
                break
            node = kids[0]
            path.append(node)
        out.append((path, target))
    return out


VERIFIER_NODES = [{"type": "greedy"}, {"type": "rejection"}, {"type": "threshold"},
                  {"type": "threshold", "threshold_single": 0.3, "threshold_acc": 0.5},
                  {"type": "typical"}, {"type": "typical", "epsilon": 0.9, "delta": 5.0}]


@pytest.mark.parametrize("node", VERIFIER_NODES, ids=lambda n: "-".join(map(str, n.values())))
@settings(max_examples=40, deadline=None)
@given(tree=random_trees(), seed=st.integers(0, 2**16), top_k=st.sampled_from([-1, 1, 2]),
       top_p=st.sampled_from([1.0, 0.5]), slack=st.sampled_from([None, 0, 2]))
def test_temperature_zero_commits_the_greedy_walk(node, tree, seed, top_k, top_p, slack):
    """``slack``: the tree carries a depth bound (max_depth, as a builder on the device gives
    it), exact or loose; the walk is the same."""
    verifier = build_component(VERIFIERS, node)
    if slack is not None:
        tree.max_depth = int(tree.depth.max()) + slack
    b, n = tree.tokens.shape
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(-2, 3, (b, n, VOCAB), generator=g).float()  # integers: argmax ties too
    params = SamplingParams(temperature=0.0, top_k=top_k, top_p=top_p)
    sampling = SamplingBatch.from_params([params] * b, [seed + r for r in range(b)])
    verdict = verifier.verify(tree, logits, sampling)
    max_depth = int(tree.depth.max())
    assert verdict.accepted.shape in ((b, max_depth + 1), (b, (tree.max_depth or 0) + 1))
    for r, (path, bonus) in enumerate(greedy_walk(tree, logits)):
        assert verdict.accepted_nodes(r) == path
        assert verdict.accepted[r, len(path):].eq(-1).all()
        assert int(verdict.accept_len[r]) == len(path) - 1
        assert int(verdict.bonus_tokens[r]) == bonus


def test_every_verifier_is_registered_with_its_losslessness():
    assert set(VERIFIERS.names()) >= {"greedy", "rejection", "threshold", "typical"}
    lossless = {name: build_component(VERIFIERS, {"type": name}).lossless for name in VERIFIERS.names()}
    assert lossless == {"greedy": True, "rejection": True, "threshold": True, "typical": False}


def test_greedy_verifier_follows_the_target_draws_when_sampling():
    """At temperature > 0 the target's token at each node is a draw: with a target certain at
    every node (one logit far above the rest) the walk is the argmax walk; the statistical test
    of the sampled case is test_rejection's exact-match case."""
    # root -> [1, 2], 1 -> [0]; the target picks 2 at the root and then 0 after it
    tree = DraftTree(tokens=torch.tensor([[0, 1, 2, 0]]), parents=torch.tensor([[-1, 0, 0, 1]]),
                     depth=torch.tensor([[0, 1, 1, 2]]), positions=torch.tensor([[3, 4, 4, 5]]),
                     scores=torch.ones(1, 4), valid=torch.ones(1, 4, dtype=torch.bool),
                     sampled=torch.zeros(1, 4, dtype=torch.bool))  # no mask: the verifier builds it
    logits = 100 * torch.tensor([[[0.0, 1.0, 2.0], [3.0, 0.0, 0.0], [5.0, 0.0, 1.0], [0.0, 0.0, 0.0]]])
    sampling = SamplingBatch.from_params([SamplingParams(temperature=1.5)], [0])
    verdict = GreedyVerifier().verify(tree, logits, sampling)
    assert verdict.accepted.tolist() == [[0, 2, -1]] and verdict.bonus_tokens.tolist() == [0]


@pytest.mark.parametrize("node", VERIFIER_NODES, ids=lambda n: "-".join(map(str, n.values())))
@settings(max_examples=25, deadline=None)
@given(tree=random_trees(), seed=st.integers(0, 2**16), greedy=st.lists(st.booleans(), min_size=3, max_size=3))
def test_a_row_s_verdict_does_not_depend_on_its_batch_mates(node, tree, seed, greedy):
    """Greedy and sampled rows in one batch: each row's verdict is the one it gets verified alone
    (a batch-wide shortcut taken when *some* row is greedy would walk a sampled row's argmax)."""
    verifier = build_component(VERIFIERS, node)
    b, n = tree.tokens.shape
    logits = torch.randn(b, n, VOCAB, generator=torch.Generator().manual_seed(seed))
    params = [SamplingParams(temperature=0.0 if g else 0.8) for g in greedy[:b]]
    seeds = [seed + r for r in range(b)]
    verdict = verifier.verify(tree, logits, SamplingBatch.from_params(params, seeds))
    for r in range(b):
        alone = dataclasses.replace(tree, **{f.name: getattr(tree, f.name)[r:r + 1] for f in dataclasses.fields(tree)
                                             if isinstance(getattr(tree, f.name), torch.Tensor)})
        own = verifier.verify(alone, logits[r:r + 1], SamplingBatch.from_params(params[r:r + 1], seeds[r:r + 1]))
        assert verdict.accepted_nodes(r) == own.accepted_nodes(0)
        assert int(verdict.bonus_tokens[r]) == int(own.bonus_tokens[0])
