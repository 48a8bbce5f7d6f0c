"""Scratch: the tree nodes every request fed in its current build, their masks and their lookup
by token path. (Drafting through it is tested with every drafter in tests/drafters.)"""

import numpy as np
import pytest

from specflow.runtime.draft_scratch import Scratch

TOKENS = np.array([[7, 11, 12, 13, 14]])  # one tree: 0 -> 1, 2; 1 -> 3; 2 -> 4
PARENTS = np.array([[-1, 0, 0, 1, 2]])


def test_scratch_masks_are_ancestors_and_a_node_is_fed_once():
    scratch = Scratch()
    slot = np.array([scratch.acquire()])
    scratch.start(slot, TOKENS[:, 0])
    *_, entries = scratch.feed(slot, np.array([[1, -1, 2]]), TOKENS, PARENTS)  # -1: no node in that column
    assert entries.tolist() == [1, 2]
    assert scratch.visible[slot[0], 1:3, :3].tolist() == [[True, True, False], [True, False, True]]
    *_, entries = scratch.feed(slot, np.array([[4, 3]]), TOKENS, PARENTS)
    assert entries.tolist() == [3, 4]
    assert scratch.visible[slot[0], 3:5, :5].tolist() == [[True, False, True, True, False],
                                                          [True, True, False, False, True]]
    assert scratch.path(slot[0], [7, 11, 13]) == [0, 1, 4] and scratch.path(slot[0], [7, 12, 99]) == [0, 2]
    with pytest.raises(AssertionError, match="fed once"):
        scratch.feed(slot, np.array([[3]]), TOKENS, PARENTS)
    scratch.clear(slot[0])
    scratch.start(slot, np.array([5]))
    with pytest.raises(AssertionError, match="fed once"):  # the same node twice in one frontier
        scratch.feed(slot, np.array([[1, 1]]), np.array([[5, 3]]), np.array([[-1, 0]]))
    assert scratch.size[slot[0]] == 1 and (scratch.node[slot[0], 1:] == -1).all()  # refused before any write
    with pytest.raises(AssertionError, match="parent"):  # the root fed holds another token
        scratch.feed(slot, np.array([[1]]), TOKENS, PARENTS)
    scratch.release(slot[0])
    assert not scratch.visible.any() and (scratch.node == -1).all() and not scratch.size.any()
    with pytest.raises(AssertionError, match="released once"):
        scratch.release(slot[0])


def test_scratch_feeds_many_requests_at_once_and_grows():
    """Slots are independent; acquiring past the initial slots and feeding past the initial
    entries grow the arrays and keep what was fed."""
    scratch = Scratch(slots=2, entries=2, nodes=2)
    slots = np.array([scratch.acquire() for _ in range(3)])
    tokens = np.array([[7, 11, 12, 13, 14], [8, 21, 22, 23, 24], [9, 31, 32, 33, 34]])
    parents = np.repeat(PARENTS, 3, 0)
    scratch.start(slots, tokens[:, 0])
    *_, entries = scratch.feed(slots, np.array([[1, 2], [2, -1], [-1, -1]]), tokens, parents)
    assert entries.tolist() == [1, 2, 1] and scratch.size[slots].tolist() == [3, 2, 1]
    *_, entries = scratch.feed(slots[:2], np.array([[3, 4], [4, -1]]), tokens[:2], parents[:2])
    assert entries.tolist() == [3, 4, 2] and scratch.size[slots].tolist() == [5, 3, 1]
    assert scratch.path(slots[0], [7, 12, 14]) == [0, 2, 4]
    assert scratch.path(slots[1], [8, 22, 24]) == [0, 1, 2]
    assert scratch.visible[slots[1], :3, :3].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    scratch.clear(slots)
    assert not scratch.size.any() and not scratch.visible.any()


def test_a_path_follows_its_parents_past_nodes_elsewhere_that_hold_the_same_token():
    """``path`` finds each token among the children of the entry before it: a node with the same
    token under another parent (fed earlier) holds K/V of another path and is not taken."""
    tokens = np.array([[7, 11, 12, 30, 30]])   # 0 -> 1, 2; 1 -> 3 (30); 2 -> 4 (30)
    parents = np.array([[-1, 0, 0, 1, 2]])
    scratch = Scratch()
    slot = np.array([scratch.acquire()])
    scratch.start(slot, tokens[:, 0])
    scratch.feed(slot, np.array([[1, 2]]), tokens, parents)
    scratch.feed(slot, np.array([[3, 4]]), tokens, parents)
    assert scratch.path(slot[0], [7, 12, 30]) == [0, 2, 4] and scratch.path(slot[0], [7, 11, 30]) == [0, 1, 3]
    assert scratch.path(slot[0], [7, 30]) == [0]   # 30 is no child of the root
