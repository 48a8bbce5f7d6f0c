import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specflow.config import build_component
from specflow.registry import TREE_BUILDERS
from tests.trees.table_drafter import TableDrafter, check_built_tree, make_roots
from trees.eagle2 import Eagle2Builder


def reference_paths(drafter: TableDrafter, context: tuple, topk: int, depth: int, n: int) -> set:
    """EAGLE-2 written out per request: beam of topk by cumulative log-prob, then top n - 1."""
    candidates = []                               # (logscore, path) in candidate order
    frontier = [(torch.tensor(0.0), ())]
    for _ in range(depth):
        children = []
        for score, path in frontier:
            lp = drafter.logprobs(context + path)
            top, order = lp.sort(descending=True, stable=True)
            children += [(score + l, path + (int(t),)) for l, t in zip(top[:topk], order[:topk])
                         if l > float("-inf")]
        candidates += children
        frontier = sorted(children, key=lambda c: -float(c[0]))[:topk]  # sorted() is stable
    chosen = sorted(candidates, key=lambda c: -float(c[0]))[:n - 1]
    return {path for _, path in chosen}


def tree_paths(tree, r: int) -> set:
    return {tuple(tree.tokens[r, tree.path_to(r, i)[1:]].tolist())
            for i in range(1, tree.num_nodes) if tree.valid[r, i]}


@settings(max_examples=30, deadline=None)
@given(topk=st.integers(1, 4), depth=st.integers(1, 4), n=st.integers(2, 20), batch=st.integers(1, 3),
       seed=st.integers(0, 2**16), ties=st.booleans(), max_children=st.sampled_from([None, 1, 2]))
def test_eagle2_matches_the_reference_beam_and_rerank(topk, depth, n, batch, seed, ties, max_children):
    n = min(n, max_nodes(topk, depth))
    drafter = TableDrafter(vocab=6, seed=seed, ties=ties, max_children=max_children)
    roots = make_roots(batch, 6, seed)
    tree = Eagle2Builder(topk=topk, depth=depth, num_draft_tokens=n).build(drafter, roots)
    check_built_tree(tree, n, roots, drafter)
    for r in range(batch):
        assert tree_paths(tree, r) == reference_paths(drafter, tuple(roots.contexts[r]), topk, depth, n)


@settings(max_examples=30, deadline=None)
@given(topk=st.integers(1, 4), depth=st.integers(1, 4), n=st.integers(2, 24), seed=st.integers(0, 2**16),
       ties=st.booleans(), nan_rate=st.sampled_from([0.2, 0.5]), max_children=st.sampled_from([None, 1]))
def test_rerank_keeps_every_ancestor_with_ties_and_nans(topk, depth, n, seed, ties, nan_rate, max_children):
    n = min(n, max_nodes(topk, depth))
    drafter = TableDrafter(vocab=5, seed=seed, ties=ties, nan_rate=nan_rate, max_children=max_children)
    roots = make_roots(3, 5, seed)
    tree = Eagle2Builder(topk=topk, depth=depth, num_draft_tokens=n).build(drafter, roots)
    check_built_tree(tree, n, roots, drafter)  # includes: a valid node's parent is valid


def test_frontier_is_the_root_then_topk_nodes():
    drafter = TableDrafter(vocab=10, seed=2)
    Eagle2Builder(topk=3, depth=4, num_draft_tokens=12).build(drafter, make_roots(2, 10))
    assert [tuple(c.nodes.shape) for c in drafter.calls] == [(2, 1), (2, 3), (2, 3), (2, 3)]
    assert all(c.k == 3 for c in drafter.calls)
    assert [c.tree.num_nodes for c in drafter.calls] == [1, 4, 13, 22]  # all candidates so far


def max_nodes(topk: int, depth: int) -> int:
    return 1 + topk + (depth - 1) * topk * topk


def test_budget_is_capped_at_the_candidates():
    assert Eagle2Builder(topk=2, depth=2, num_draft_tokens=8).num_draft_tokens == max_nodes(2, 2) == 7
    assert Eagle2Builder(topk=1, depth=5, num_draft_tokens=16).num_draft_tokens == 6  # a chain
    assert Eagle2Builder(topk=8, depth=5, num_draft_tokens=64).num_draft_tokens == 64


def test_budget_beyond_the_candidates_is_padding():
    drafter = TableDrafter(vocab=10, seed=4, max_children=1)  # one child a node: 1 + 1 + 1 candidates
    roots = make_roots(2, 10)
    tree = Eagle2Builder(topk=2, depth=2, num_draft_tokens=7).build(drafter, roots)
    check_built_tree(tree, 7, roots, drafter)
    assert tree.valid.sum(1).tolist() == [3, 3]


@pytest.mark.parametrize("kwargs, match", [
    ({"topk": 0}, "topk"), ({"depth": 0}, "depth"), ({"num_draft_tokens": 0}, "num_draft_tokens"),
])
def test_bad_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Eagle2Builder(**kwargs)


def test_config_path():
    builder = build_component(TREE_BUILDERS, {"type": "eagle2", "topk": 4, "depth": 3, "num_draft_tokens": 9})
    assert (builder.topk, builder.depth, builder.num_draft_tokens) == (4, 3, 9)


def test_children_tying_their_parent_never_displace_it():
    """With at most one child per node, q(child) = 1 and every child ties its parent's score."""
    ties = 0
    for seed in range(10):
        drafter = TableDrafter(vocab=5, seed=seed, max_children=1)
        roots = make_roots(3, 5, seed)
        tree = Eagle2Builder(topk=2, depth=4, num_draft_tokens=3).build(drafter, roots)
        check_built_tree(tree, 3, roots, drafter)
        parent_scores = tree.scores.gather(1, tree.parents.clamp(min=0))
        ties += int((tree.valid[:, 1:] & (tree.scores[:, 1:] == parent_scores[:, 1:])).sum())
    assert ties > 0
