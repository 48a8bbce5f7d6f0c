from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specflow.config import build_component
from specflow.registry import TREE_BUILDERS
from tests.trees.table_drafter import TableDrafter, check_built_tree, make_roots
from trees.bfs import BfsBuilder


def test_breadth_shrinks_per_level():
    builder = BfsBuilder(min_breadth=1, max_breadth=4, depth=6, num_draft_tokens=16)
    assert [builder.breadth(level) for level in range(6)] == [4, 3, 2, 1, 1, 1]


@pytest.mark.parametrize("n, depth, per_level", [
    (16, 6, {1: 4, 2: 11}),              # 4 + 4*3 = 16 > 15: the budget ends inside level 2
    (64, 6, {1: 4, 2: 12, 3: 24, 4: 23}),  # 4, 12, 24, then 24 of level 4 minus what no longer fits
    (64, 2, {1: 4, 2: 12}),              # depth caps it
    (2, 6, {1: 1}),
])
def test_full_drafter_fills_levels_in_bfs_order(n, depth, per_level):
    builder = BfsBuilder(min_breadth=1, max_breadth=4, depth=depth, num_draft_tokens=n)
    drafter = TableDrafter(vocab=8, seed=3)
    roots = make_roots(2, 8)
    tree = builder.build(drafter, roots)
    check_built_tree(tree, n, roots, drafter)
    for r in range(2):
        valid = tree.valid[r].clone()
        valid[0] = False
        assert dict(Counter(tree.depth[r, valid].tolist())) == per_level
        assert tree.depth[r, tree.valid[r]].tolist() == sorted(tree.depth[r, tree.valid[r]].tolist())
        parents = tree.parents[r, valid].tolist()
        assert parents == sorted(parents)  # BFS order: children grouped by parent, parents in order


def test_missing_children_leave_budget_for_deeper_levels():
    drafter = TableDrafter(vocab=8, seed=0, min_children=1, max_children=2)  # an n-gram-like drafter
    roots = make_roots(3, 8, seed=1)
    builder = BfsBuilder(min_breadth=1, max_breadth=4, depth=6, num_draft_tokens=12)
    tree = builder.build(drafter, roots)
    check_built_tree(tree, 12, roots, drafter)
    # with 4 children per root, 11 nodes would end at depth 2; with at most 2 they go deeper
    assert tree.valid.all() and (tree.depth.amax(1) > 2).all()


@settings(max_examples=30, deadline=None)
@given(min_breadth=st.integers(1, 3), extra=st.integers(0, 3), depth=st.integers(1, 5), n=st.integers(2, 24),
       batch=st.integers(1, 3), seed=st.integers(0, 2**16), max_children=st.sampled_from([None, 1, 3]))
def test_bfs_builds_valid_trees(min_breadth, extra, depth, n, batch, seed, max_children):
    builder = BfsBuilder(min_breadth=min_breadth, max_breadth=min_breadth + extra, depth=depth,
                         num_draft_tokens=n)
    drafter = TableDrafter(vocab=6, seed=seed, max_children=max_children)
    roots = make_roots(batch, 6, seed)
    tree = builder.build(drafter, roots)
    check_built_tree(tree, n, roots, drafter)
    assert int(tree.depth[tree.valid].max()) <= depth
    for r in range(batch):  # existing children are packed: valid nodes first, padding after
        n_valid = int(tree.valid[r].sum())
        assert tree.valid[r, :n_valid].all()


@pytest.mark.parametrize("kwargs, match", [
    ({"min_breadth": 0}, "min_breadth"), ({"min_breadth": 3, "max_breadth": 2}, "max_breadth"),
    ({"depth": 0}, "depth"), ({"num_draft_tokens": 1}, "num_draft_tokens"),
])
def test_bad_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BfsBuilder(**kwargs)


def test_config_path():
    builder = build_component(TREE_BUILDERS, {"type": "bfs", "max_breadth": 3, "num_draft_tokens": 8})
    assert (builder.max_breadth, builder.num_draft_tokens) == (3, 8)


def test_a_request_s_tree_does_not_depend_on_its_batch_mates():
    """Each request expands every node it placed at a level, however many its batch mates placed:
    in a batch, a request's tree is the one it gets alone."""
    drafter = TableDrafter(vocab=8, seed=4, min_children=1, max_children=4)
    roots = make_roots(4, 8, seed=2)
    builder = BfsBuilder(min_breadth=1, max_breadth=4, depth=4, num_draft_tokens=14)
    batched = builder.build(drafter, roots)
    for r in range(4):
        alone = builder.build(drafter, roots.select([r]))
        for field in ("tokens", "parents", "valid"):
            assert torch.equal(getattr(batched, field)[r], getattr(alone, field)[0]), (r, field)
