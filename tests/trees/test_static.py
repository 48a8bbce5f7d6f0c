from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specflow.config import build_component
from specflow.registry import TREE_BUILDERS
from specflow.tree import DraftTree
from tests.trees.table_drafter import TableDrafter, check_built_tree, make_roots
from tests.verifiers.test_rejection import most_tries
from trees.static import PRESETS, StaticBuilder


def test_presets_have_their_published_sizes():
    eagle = StaticBuilder(preset="mc_sim_7b_63")
    assert eagle.num_draft_tokens == 26 and max(map(len, eagle.choices)) == 5
    medusa = StaticBuilder(preset="medusa_63")
    assert medusa.num_draft_tokens == 64
    assert Counter(map(len, medusa.choices)) == {1: 10, 2: 28, 3: 23, 4: 2}


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_tree_has_the_choices_shape_and_rank_tokens(preset):
    builder = StaticBuilder(preset=preset)
    drafter = TableDrafter(vocab=16, seed=1)
    roots = make_roots(2, 16)
    tree = builder.build(drafter, roots)
    check_built_tree(tree, builder.num_draft_tokens, roots, drafter)
    assert tree.valid.all() and tree.max_tries == most_tries(tree)  # (6 and 12: N - 1 is 25 and 63)
    node = {(): 0} | {p: i + 1 for i, p in enumerate(builder.choices)}
    for path, i in node.items():
        if not path:
            continue
        assert int(tree.parents[0, i]) == node[path[:-1]] and int(tree.depth[0, i]) == len(path)
        for r in range(2):  # path [.., j] is the parent's j-th most likely child
            lp = drafter.logprobs(drafter.sequence(roots, tree, r, node[path[:-1]]))
            ranked = lp.sort(descending=True, stable=True).indices
            assert int(tree.tokens[r, i]) == int(ranked[path[-1]])


def test_levels_expand_only_parents_with_children():
    builder = StaticBuilder(choices=[[0], [1], [2], [0, 0], [0, 1], [2, 0], [0, 0, 0]])
    drafter = TableDrafter(vocab=8)
    builder.build(drafter, make_roots(1, 8))
    assert [(c.nodes.tolist(), c.k) for c in drafter.calls] == [([[0]], 3), ([[1, 3]], 2), ([[4]], 1)]


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), batch=st.integers(1, 3), max_children=st.sampled_from([None, 1, 2, 3]),
       sample=st.booleans(), data=st.data())
def test_random_choices_build_valid_trees(seed, batch, max_children, sample, data):
    paths: set[tuple[int, ...]] = set()
    for _ in range(data.draw(st.integers(1, 12))):  # grow a prefix-closed set, ranks without gaps
        parent = data.draw(st.sampled_from(sorted({()} | paths)))
        rank = sum(1 for p in paths if p[:-1] == parent)
        if len(parent) < 4:
            paths.add(parent + (rank,))
    builder = StaticBuilder(choices=[list(p) for p in paths], sample=sample)
    drafter = TableDrafter(vocab=6, seed=seed, max_children=max_children)
    roots = make_roots(batch, 6, seed, greedy=[r == 0 for r in range(batch)])
    tree = builder.build(drafter, roots)
    check_built_tree(tree, len(paths) + 1, roots, drafter)
    assert most_tries(tree) <= tree.max_tries and (most_tries(tree) == tree.max_tries or not tree.valid.all())
    drafted = tree.valid.clone()
    drafted[:, 0] = False  # every valid node but the root was drafted
    assert not tree.sampled[0].any()  # request 0 is greedy: top-k picks
    assert torch.equal(tree.sampled[1:], drafted[1:] if sample else torch.zeros_like(drafted[1:]))


def test_rows_placed_beside_plain_rows_keep_the_walk_bound():
    """(the engine's step when some requests do not speculate: root-only rows padded to N)"""
    builder = StaticBuilder(preset="mc_sim_7b_63", sample=True)
    roots = make_roots(3, 16)
    tree = builder.build(TableDrafter(vocab=16, seed=1), roots.select([0, 2]))
    mixed = DraftTree.root_only(roots).pad_to(builder.num_draft_tokens).place([0, 2], tree)
    assert mixed.max_tries == tree.max_tries == most_tries(mixed) == 6
    assert torch.equal(mixed.tokens[[0, 2]], tree.tokens) and mixed.to(torch.device("cpu")).max_tries == 6


def test_missing_prefix_names_the_path_and_the_prefix():
    with pytest.raises(ValueError, match=r"\[0, 1, 2\] needs its prefix \[0, 1\]"):
        StaticBuilder(choices=[[0], [0, 0], [0, 1, 2]])


@pytest.mark.parametrize("kwargs, match", [
    ({}, r"exactly one of choices \(rank paths, e.g. \[\[0\], \[1\], \[0, 0\]\]\) or preset \(one of "
         r"mc_sim_7b_63, medusa_63\)$"),
    ({"choices": [[0]], "preset": "mc_sim_7b_63"}, "exactly one.*null the key it had"),
    ({"preset": "nope"}, "unknown preset 'nope'; known: mc_sim_7b_63, medusa_63"),
    ({"choices": [[0], [0]]}, "appears twice"),
    ({"choices": [[]]}, "non-empty"),
    ({"choices": []}, "at least one"),
    ({"choices": [[0], [2]], "sample": True}, "without gaps"),
])
def test_bad_choices_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StaticBuilder(**kwargs)


def test_config_path():
    builder = build_component(TREE_BUILDERS, {"type": "static", "choices": [[0], [1], [0, 0]]})
    assert builder.num_draft_tokens == 4
    assert build_component(TREE_BUILDERS, {"type": "static", "preset": "medusa_63"}).num_draft_tokens == 64
