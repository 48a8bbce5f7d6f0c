"""Scratch: the tree nodes a drafter fed in one build, their masks and their lookup by token path.
(Drafting through it is tested with every drafter in tests/drafters.)"""

import numpy as np
import pytest

from specflow.runtime.draft_runner import Scratch


def test_scratch_masks_are_ancestors_and_a_node_is_fed_once():
    scratch = Scratch()
    scratch.start(root_token=7)
    tokens = np.array([7, 11, 12, 13, 14])  # tree: 0 -> 1, 2; 1 -> 3; 2 -> 4
    parents = np.array([-1, 0, 0, 1, 2])
    entries, mask = scratch.feed(np.array([1, 2]), tokens[[1, 2]], np.array([0, 0]), tokens[[0, 0]], 5)
    assert entries.tolist() == [1, 2] and mask.tolist() == [[True, True, False], [True, False, True]]
    entries, mask = scratch.feed(np.array([4, 3]), tokens[[4, 3]], parents[[4, 3]], tokens[parents[[4, 3]]], 5)
    assert mask.tolist() == [[True, False, True, True, False], [True, True, False, False, True]]
    assert scratch.path([7, 11, 13]) == [0, 1, 4] and scratch.path([7, 12, 99]) == [0, 2]
    with pytest.raises(AssertionError, match="fed once"):
        scratch.feed(np.array([3]), tokens[[3]], parents[[3]], tokens[[1]], 5)
    scratch.clear()
    scratch.start(root_token=5)
    with pytest.raises(AssertionError, match="fed once"):  # the same node twice in one frontier
        scratch.feed(np.array([1, 1]), np.array([3, 3]), np.array([0, 0]), np.array([5, 5]), 5)
    scratch.clear()
    assert not scratch.visible.any() and (scratch.node == -1).all()
