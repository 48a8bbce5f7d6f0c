import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specflow.config import build_component
from specflow.registry import VERIFIERS
from specflow.sampling import SamplingBatch, SamplingParams
from specflow.tree import DraftTree
from tests.verifiers.test_greedy import VOCAB, random_trees
from verifiers.typical import TypicalVerifier


def star_tree(children: list[int]) -> DraftTree:
    """The root with the given child tokens, each with one child token 0 below it."""
    k = len(children)
    tokens = [0] + children + [0] * k
    parents = [-1] + [0] * k + list(range(1, k + 1))
    depth = [0] + [1] * k + [2] * k
    return DraftTree(torch.tensor([tokens]), torch.tensor([parents]), torch.tensor([depth]),
                     torch.tensor([depth]), torch.ones(1, 2 * k + 1), torch.ones(1, 2 * k + 1, dtype=torch.bool),
                     torch.zeros(1, 2 * k + 1, dtype=torch.bool)).with_mask()


def typical_floor(p: torch.Tensor, epsilon: float, delta: float) -> float:
    entropy = -sum(float(x) * math.log(float(x)) for x in p if x > 0)
    return min(epsilon, delta * math.exp(-entropy))


def test_accepts_the_first_child_above_the_entropy_scaled_floor():
    root = torch.tensor([2.0, 1.6, 1.0, -3.0])  # p ~ [.49, .33, .18, .003]: H ~ 1.04, floor = min(.09, .11)
    after = torch.tensor([0.0, 0.0, 0.0, 9.0])  # below each child: almost surely token 3
    logits = torch.stack([root] + [after] * 6).unsqueeze(0)  # [1, 7, 4]
    p = torch.softmax(root, -1)
    floor = typical_floor(p, 0.09, 0.3)
    assert p[3] < floor < p[2]
    sampling = SamplingBatch.from_params([SamplingParams(temperature=1.0)], [0])
    # children in index order 3, 2, 0: token 3 is atypical, token 2 is the first to pass
    verdict = TypicalVerifier().verify(star_tree([3, 2, 0]), logits, sampling)
    assert verdict.accepted.tolist() == [[0, 2, -1]]  # node 5 (token 0) fails below: p(0) tiny
    assert verdict.bonus_tokens.tolist() == [3]


def test_temperature_scales_the_typical_probabilities():
    root = torch.tensor([2.0, 1.6, 1.0, -3.0])
    logits = torch.stack([root] + [torch.zeros(4)] * 2).unsqueeze(0)
    tree = star_tree([3])
    hot = SamplingBatch.from_params([SamplingParams(temperature=5.0)], [0])
    cold = SamplingBatch.from_params([SamplingParams(temperature=1.0)], [0])
    # at T = 5, p(3) ~ 0.12 clears the floor min(.09, .3 exp(-H ~ 1.33)) ~ 0.08; at T = 1 (0.003) it does not
    assert TypicalVerifier().verify(tree, logits, hot).accepted[0, 1] == 1
    assert TypicalVerifier().verify(tree, logits, cold).accepted[0, 1] == -1


def test_config_and_bad_parameters():
    verifier = build_component(VERIFIERS, {"type": "typical", "epsilon": 0.2})
    assert (verifier.epsilon, verifier.delta, verifier.lossless) == (0.2, 0.3, False)
    with pytest.raises(ValueError, match="epsilon"):
        TypicalVerifier(epsilon=0.0)
    with pytest.raises(ValueError, match="delta"):
        TypicalVerifier(delta=-1.0)


def test_each_request_draws_its_bonus_at_its_own_last_node():
    """Two requests stop at different depths; each bonus comes from its own last accepted node's
    processed distribution (top-k 1 there: its argmax), not from another node's or request's."""
    root = torch.tensor([2.0, 1.6, 1.0, -3.0])
    after = torch.tensor([0.0, 0.0, 0.0, 9.0])
    accepts = torch.stack([root] + [after] * 6)                                       # [7, 4]: stops at node 2
    rejects = torch.stack([torch.tensor([-9.0, 9.0, -9.0, -9.0])] + [after] * 6)      # stops at the root
    sampling = SamplingBatch.from_params([SamplingParams(temperature=1.0, top_k=1)] * 2,
                                         [0, 1])
    tree = star_tree([3, 2, 0])
    tree = DraftTree(*(torch.cat([x, x]) for x in (tree.tokens, tree.parents, tree.depth, tree.positions,
                                                   tree.scores, tree.valid, tree.sampled))).with_mask()
    verdict = TypicalVerifier().verify(tree, torch.stack([accepts, rejects]), sampling)
    assert verdict.accepted.tolist() == [[0, 2, -1], [0, -1, -1]]
    assert verdict.bonus_tokens.tolist() == [3, 1]


def test_a_child_is_judged_by_its_parent_s_floor():
    """Chain root -> token 0 -> token 0, epsilon 0.5, delta 0.9: the root is uncertain (floor
    ~0.31, and p(0) = 0.4 clears it), node 1 is peaked (floor 0.5, and p(0) = 0.98 clears it), so
    both drafts pass; judging node 1 by its own floor (0.5 > 0.4) would stop at the root."""
    root = torch.tensor([0.4, 0.35, 0.25]).log()
    peaked = torch.tensor([0.98, 0.01, 0.01]).log()
    floors = [typical_floor(torch.softmax(x, -1), 0.5, 0.9) for x in (root, peaked)]
    assert floors[0] < 0.4 < floors[1] < 0.98
    tree = DraftTree(torch.tensor([[0, 0, 0]]), torch.tensor([[-1, 0, 1]]), torch.tensor([[0, 1, 2]]),
                     torch.tensor([[0, 1, 2]]), torch.ones(1, 3), torch.ones(1, 3, dtype=torch.bool),
                     torch.zeros(1, 3, dtype=torch.bool)).with_mask()
    logits = torch.stack([root, peaked, torch.zeros(3)]).unsqueeze(0)  # [1, 3, 3]
    sampling = SamplingBatch.from_params([SamplingParams(temperature=1.0)], [0])
    assert TypicalVerifier(epsilon=0.5, delta=0.9).verify(tree, logits, sampling).accepted.tolist() == [[0, 1, 2]]


def typical_walk(tree: DraftTree, logits: torch.Tensor, params: list[SamplingParams], epsilon: float,
                 delta: float) -> list[list[int] | None]:
    """Reference: Medusa's rule one request and one node at a time, in float64: a child passes
    when its token's probability under softmax(logits / T) *at its parent* exceeds that parent's
    floor min(epsilon, delta exp(-H)); a greedy request follows the argmax. The accepted path per
    request, None where a tested probability lies within float32 rounding of its floor."""
    out = []
    for b in range(tree.batch_size):
        node, path = 0, [0]
        while True:
            row = logits[b, node].double()
            if params[b].temperature == 0:
                ok = lambda x: x == int(row.argmax())  # noqa: E731
            else:
                p = torch.softmax(row / params[b].temperature, -1)
                floor = min(epsilon, delta * math.exp(-typical_entropy(p)))
                ok = lambda x: float(p[x]) > floor  # noqa: E731
                if any(abs(float(p[int(tree.tokens[b, c])]) - floor) < 1e-5 for c in range(1, tree.num_nodes)
                       if tree.valid[b, c] and tree.parents[b, c] == node):
                    path = None
                    break
            kids = [c for c in range(1, tree.num_nodes)
                    if tree.valid[b, c] and tree.parents[b, c] == node and ok(int(tree.tokens[b, c]))]
            if not kids:
                break
            node = kids[0]
            path.append(node)
        out.append(path)
    return out


def typical_entropy(p: torch.Tensor) -> float:
    return -sum(float(x) * math.log(float(x)) for x in p if x > 0)


@settings(max_examples=80, deadline=None)
@given(tree=random_trees(), seed=st.integers(0, 2**16), temperature=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
       epsilon=st.sampled_from([0.09, 0.3, 0.6]), delta=st.sampled_from([0.3, 0.9]))
def test_the_walk_is_the_per_node_rule(tree, seed, temperature, epsilon, delta):
    """Random trees (padding, duplicate siblings), each node's floor from its own entropy, both
    sides of min(epsilon, delta exp(-H)) and a greedy request beside sampled ones: a child is
    judged by its parent's distribution and floor. (The hand-made tests above have one floor
    for every node, and epsilon the smaller term.)"""
    b, n = tree.tokens.shape
    logits = torch.randn(b, n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2
    params = [SamplingParams(temperature=0.0 if r == 1 else temperature) for r in range(b)]
    sampling = SamplingBatch.from_params(params, [seed + r for r in range(b)])
    verdict = TypicalVerifier(epsilon, delta).verify(tree, logits, sampling)
    for r, path in enumerate(typical_walk(tree, logits, params, epsilon, delta)):
        assert path is None or verdict.accepted_nodes(r) == path
