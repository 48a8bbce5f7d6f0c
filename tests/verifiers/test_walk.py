"""The host walk's tree links against a direct reading of ``parents``."""

from hypothesis import given, settings

from tests.verifiers.test_greedy import random_trees
from verifiers.walk import first_child_next_sibling


@settings(max_examples=80, deadline=None)
@given(tree=random_trees())
def test_first_child_and_next_sibling_follow_index_order(tree):
    first, after = first_child_next_sibling(tree.parents.numpy(), tree.valid.numpy())
    for b in range(tree.batch_size):
        for i in range(tree.num_nodes):
            kids = [j for j in range(1, tree.num_nodes) if tree.valid[b, j] and tree.parents[b, j] == i]
            assert first[b, i] == (kids[0] if kids else -1)
            siblings = [j for j in range(i + 1, tree.num_nodes)
                        if tree.valid[b, j] and tree.parents[b, j] == tree.parents[b, i]]
            assert after[b, i] == (siblings[0] if siblings and i > 0 and tree.valid[b, i] else -1)
