import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specflow.config import build_component
from specflow.registry import TREE_BUILDERS
from tests.trees.table_drafter import TableDrafter, check_built_tree, make_roots
from trees.chain import ChainBuilder


@settings(max_examples=25, deadline=None)
@given(depth=st.integers(1, 5), batch=st.integers(1, 3), seed=st.integers(0, 2**16),
       max_children=st.sampled_from([None, 1, 2]), sample=st.booleans())
def test_chain_is_a_valid_tree_of_depth_plus_one_nodes(depth, batch, seed, max_children, sample):
    drafter = TableDrafter(vocab=7, seed=seed, max_children=max_children)
    roots = make_roots(batch, 7, seed, greedy=[r % 2 == 0 for r in range(batch)])
    tree = ChainBuilder(depth=depth, sample=sample).build(drafter, roots)
    check_built_tree(tree, depth + 1, roots, drafter)
    # a chain: node i hangs under node i - 1 until the drafter runs dry, padding after
    for r in range(batch):
        n_valid = int(tree.valid[r].sum())
        assert tree.valid[r, :n_valid].all()
        assert tree.parents[r, 1:n_valid].tolist() == list(range(n_valid - 1))
    # the engine moves a host tree to the target's device; the move reads its depth bound
    moved = tree.to(torch.device("cpu"))
    assert moved.max_depth == int(tree.depth.max()) and torch.equal(moved.mask, tree.mask)


def test_greedy_chain_follows_the_drafter_argmax():
    drafter = TableDrafter(vocab=11, seed=3)
    roots = make_roots(2, 11, seed=1)
    tree = ChainBuilder(depth=4).build(drafter, roots)
    for r in range(2):
        seq = tuple(roots.contexts[r])
        for i in range(1, 5):
            token = int(drafter.logprobs(seq).argmax())
            assert int(tree.tokens[r, i]) == token
            seq += (token,)
    assert not tree.sampled.any() and tree.draft_probs is None
    assert len(drafter.calls) == 4 and all(c.k == 1 and not c.want_probs for c in drafter.calls)


def test_drafter_without_children_pads_the_rest():
    drafter = TableDrafter(vocab=5, seed=0, max_children=0)  # never has a child
    roots = make_roots(3, 5)
    tree = ChainBuilder(depth=3).build(drafter, roots)
    assert tree.valid.tolist() == [[True, False, False, False]] * 3
    check_built_tree(tree, 4, roots, drafter)


def test_sampled_chain_draws_from_q_and_records_it():
    drafter = TableDrafter(vocab=6, seed=5)
    roots = make_roots(4, 6, seed=2, greedy=[False, True, False, True])
    tree = ChainBuilder(depth=3, sample=True).build(drafter, roots)
    assert tree.sampled[:, 1:].tolist() == [[True] * 3, [False] * 3, [True] * 3, [False] * 3]
    for r in range(4):
        for i in range(3):  # q over the children of node i is the drafter's distribution there
            q = drafter.logprobs(drafter.sequence(roots, tree, r, i)).exp()
            torch.testing.assert_close(tree.draft_probs[r, i], q)
        if r % 2:  # greedy rows still take the argmax
            assert int(tree.tokens[r, 1]) == int(drafter.logprobs(tuple(roots.contexts[r])).argmax())


def test_sampled_chain_first_token_follows_q():
    """The first sampled token's frequencies match q (many requests with one shared context)."""
    from scipy.stats import chisquare  # (here: the GPU machine has no scipy)
    drafter = TableDrafter(vocab=4, seed=9)
    b = 4000
    roots = make_roots(b, 4, seed=0)
    roots.contexts = [[1]] * b
    roots.tokens = torch.ones(b, dtype=torch.long)
    tree = ChainBuilder(depth=1, sample=True).build(drafter, roots)
    counts = torch.bincount(tree.tokens[:, 1], minlength=4)
    q = drafter.logprobs((1,)).double().exp()
    assert chisquare(counts.numpy(), (q / q.sum() * b).numpy()).pvalue > 1e-3


def test_sampling_needs_generators():
    roots = make_roots(1, 5)
    roots.generators = None
    with pytest.raises(ValueError, match="generators"):
        ChainBuilder(depth=2, sample=True).build(TableDrafter(5), roots)


def test_bad_depth_and_config_path():
    with pytest.raises(ValueError, match="depth"):
        ChainBuilder(depth=0)
    builder = build_component(TREE_BUILDERS, {"type": "chain", "depth": 3})
    assert isinstance(builder, ChainBuilder) and builder.num_draft_tokens == 4


def test_a_chain_that_ran_dry_asks_the_drafter_about_no_further_node():
    """Once a request's drafter has no child, the chain's later frontiers hold no node of it (-1):
    a drafter with a cache of its own is never asked to expand padding."""
    drafter = TableDrafter(vocab=5, seed=0, max_children=0)  # never has a child
    ChainBuilder(depth=3).build(drafter, make_roots(2, 5))
    assert len(drafter.calls) == 3 and (drafter.calls[0].nodes == 0).all()
    assert all((c.nodes == -1).all() for c in drafter.calls[1:])
