"""DraftTree.check: it passes every sound tree and names the invariant a broken one breaks."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specflow.tree import DraftTree, ancestor_mask
from tests.verifiers.test_rejection import most_tries


@st.composite
def trees(draw, min_nodes: int = 1) -> DraftTree:
    """A batch of random sound trees: each node's parent drawn among the nodes before it."""
    b, n = draw(st.integers(1, 3)), draw(st.integers(min_nodes, 9))
    parents = torch.tensor([[-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)] for _ in range(b)])
    depth = torch.zeros(b, n, dtype=torch.long)
    for i in range(1, n):
        depth[:, i] = depth.gather(1, parents[:, i:i + 1])[:, 0] + 1
    root = torch.tensor([draw(st.integers(0, 50)) for _ in range(b)])[:, None]
    return DraftTree(tokens=torch.randint(0, 9, (b, n)), parents=parents, depth=depth, positions=root + depth,
                     scores=torch.ones(b, n), valid=torch.ones(b, n, dtype=torch.bool),
                     sampled=torch.zeros(b, n, dtype=torch.bool), mask=ancestor_mask(parents))


@settings(max_examples=60, deadline=None)
@given(trees(), st.data())
def test_check_passes_a_sound_tree_and_refuses_any_one_mask_entry_flipped(tree, data):
    tree.check()
    b, n = tree.batch_size, tree.num_nodes
    row, i, j = data.draw(st.integers(0, b - 1)), data.draw(st.integers(0, n - 1)), data.draw(st.integers(0, n - 1))
    mask = tree.mask.clone()
    mask[row, i, j] = ~mask[row, i, j]
    with pytest.raises(ValueError, match="mask must be the ancestor-or-self mask of parents"):
        dataclasses.replace(tree, mask=mask).check()


@settings(max_examples=40, deadline=None)
@given(trees(min_nodes=2), st.data())
def test_check_refuses_a_node_whose_parent_comes_after_it_or_at_another_depth(tree, data):
    row, i = data.draw(st.integers(0, tree.batch_size - 1)), data.draw(st.integers(1, tree.num_nodes - 1))
    parents = tree.parents.clone()
    parents[row, i] = data.draw(st.integers(i, tree.num_nodes))   # itself, a later node, or past the end
    with pytest.raises(ValueError, match="every node but the root has a parent, before it"):
        dataclasses.replace(tree, parents=parents).check()
    depth = tree.depth.clone()
    depth[row, i] += data.draw(st.sampled_from([-1, 1, 2]))
    with pytest.raises(ValueError, match=r"depth = parent depth \+ 1"):
        dataclasses.replace(tree, depth=depth, positions=tree.positions[:, :1] + depth).check()


def test_check_names_a_field_of_another_shape():
    parents = torch.tensor([[-1, 0, 1]])
    tree = DraftTree(tokens=torch.tensor([[4, 5, 6]]), parents=parents, depth=torch.tensor([[0, 1, 2]]),
                     positions=torch.tensor([[7, 8, 9]]), scores=torch.ones(1, 3),
                     valid=torch.ones(1, 3, dtype=torch.bool), sampled=torch.zeros(1, 3, dtype=torch.bool),
                     mask=ancestor_mask(parents))
    tree.check()
    with pytest.raises(ValueError, match=r"depth has shape \(3,\); tokens' is \[B, N\] = \[1, 3\]"):
        dataclasses.replace(tree, depth=tree.depth[0]).check()
    with pytest.raises(ValueError, match=r"mask has shape \(1, 3, 2\), not \[B, N, N\] = \[1, 3, 3\]"):
        dataclasses.replace(tree, mask=tree.mask[:, :, :2]).check()


@settings(max_examples=60, deadline=None)
@given(trees(), st.integers(0, 4))
def test_walk_tries_counts_the_children_a_walk_tries_to_reach_each_node(tree, pad):
    tree = tree.pad_to(tree.num_nodes + pad)   # (padding is no child: it adds no tries)
    assert int(tree.walk_tries().max()) == most_tries(tree)
