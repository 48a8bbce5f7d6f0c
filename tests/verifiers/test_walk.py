"""The walk over depth against a walk one node at a time, and the tree links of rejection's walk
against a direct reading of ``parents``."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.verifiers.test_greedy import random_trees
from verifiers.walk import first_child_next_sibling
from verifiers.walk import accept_path


@settings(max_examples=80, deadline=None)
@given(tree=random_trees())
def test_first_child_and_next_sibling_follow_index_order(tree):
    first, after = first_child_next_sibling(tree.parents, tree.valid)
    for b in range(tree.batch_size):
        for i in range(tree.num_nodes):
            kids = [j for j in range(1, tree.num_nodes) if tree.valid[b, j] and tree.parents[b, j] == i]
            assert first[b, i] == (kids[0] if kids else -1)
            siblings = [j for j in range(i + 1, tree.num_nodes)
                        if tree.valid[b, j] and tree.parents[b, j] == tree.parents[b, i]]
            assert after[b, i] == (siblings[0] if siblings and i > 0 and tree.valid[b, i] else -1)


@settings(max_examples=80, deadline=None)
@given(tree=random_trees(), seed=st.integers(0, 2**16), slack=st.sampled_from([None, 0, 2]), masked=st.booleans())
def test_accept_path_takes_the_first_passing_child_at_each_depth(tree, seed, slack, masked):
    """Against a walk one node at a time; padding never passes, the root's and padding's own
    values are ignored; a depth bound (exact or loose) and a missing mask change nothing."""
    passes = torch.rand(tree.tokens.shape, generator=torch.Generator().manual_seed(seed)) < 0.6
    if slack is not None:
        tree.max_depth = int(tree.depth.max()) + slack
    if not masked:
        tree.mask = None
    accepted, accept_len, last = accept_path(tree, passes)
    for b in range(tree.batch_size):
        node, path = 0, [0]
        while (nxt := next((c for c in range(1, tree.num_nodes) if tree.valid[b, c]
                            and tree.parents[b, c] == node and passes[b, c]), None)) is not None:
            node = nxt
            path.append(node)
        assert accepted[b, : len(path)].tolist() == path and accepted[b, len(path):].eq(-1).all()
        assert (int(accept_len[b]), int(last[b])) == (len(path) - 1, node)
