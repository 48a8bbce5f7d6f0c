import math

import pytest
import torch

from specflow.config import build_component
from specflow.registry import VERIFIERS
from specflow.sampling import SamplingBatch, SamplingParams
from specflow.tree import DraftTree
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
