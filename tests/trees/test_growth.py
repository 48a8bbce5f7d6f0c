"""GrowingTree, through the builders that use it: what the verifier reads of the drafter's
answers (scores, recorded q) whatever the drafter's numbers look like."""

import torch

from specflow.tree import Expansion, Frontier
from tests.trees.table_drafter import TableDrafter, make_roots
from trees.bfs import BfsBuilder
from trees.chain import ChainBuilder


class ScaledDrafter(TableDrafter):
    """A TableDrafter whose answers are off by a constant: log-probs shifted by ``shift`` (some
    above 0, as rounding or a drafter's own scores give them), q rows scaled by ``scale`` (top-k
    probabilities left unnormalised)."""

    def __init__(self, *args, shift: float = 0.0, scale: float = 1.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.shift, self.scale = shift, scale

    def expand(self, frontier: Frontier) -> Expansion:
        out = super().expand(frontier)
        return Expansion(out.tokens, out.logprobs + self.shift, None if out.probs is None else out.probs * self.scale)


def test_a_score_never_rises_down_a_path_even_for_positive_logprobs():
    """Log-probs above 0 count as 0: every node's score is at most its parent's (EAGLE-2's rerank
    keeps a chosen node's ancestors by relying on it), and at most 1."""
    drafter = ScaledDrafter(vocab=8, seed=2, shift=3.0)
    roots = make_roots(3, 8, seed=1)
    tree = BfsBuilder(min_breadth=1, max_breadth=3, depth=3, num_draft_tokens=10).build(drafter, roots)
    assert (tree.scores <= 1.0).all()
    parent_scores = tree.scores.gather(1, tree.parents.clamp(min=0))
    assert (tree.scores[:, 1:][tree.valid[:, 1:]] <= parent_scores[:, 1:][tree.valid[:, 1:]]).all()


def test_recorded_q_is_normalised_when_the_drafter_s_is_not():
    """Sampled drafting draws from a drafter's q as its normalised law; the q recorded for the
    verifier is that law too (rows summing to 1), not the drafter's unnormalised numbers."""
    plain, scaled = TableDrafter(vocab=6, seed=5), ScaledDrafter(vocab=6, seed=5, scale=0.25)
    trees = [ChainBuilder(depth=3, sample=True).build(d, make_roots(4, 6, seed=2, greedy=[False, True] * 2))
             for d in (plain, scaled)]
    for tree in trees:
        torch.testing.assert_close(tree.draft_probs[:, :3].sum(-1), torch.ones(4, 3))
    assert torch.equal(trees[0].tokens, trees[1].tokens)  # the same draws
    torch.testing.assert_close(trees[1].draft_probs, trees[0].draft_probs)


def test_a_chain_that_ran_dry_keeps_the_q_of_the_nodes_it_expanded():
    """A frontier without nodes (-1: the request's chain ended, its drafter had no child) records
    no q: the q of the root and of every node expanded before stays what the drafter gave there."""
    drafter = TableDrafter(vocab=6, seed=1, min_children=0, max_children=2)
    roots = make_roots(16, 6, seed=3, greedy=[False] * 16)
    tree = ChainBuilder(depth=4, sample=True).build(drafter, roots)
    ran_dry = 0
    for r in range(16):
        n_valid = int(tree.valid[r].sum())
        ran_dry += n_valid < 5
        for i in range(min(n_valid, 4)):  # the nodes the chain expanded
            q = drafter.logprobs(drafter.sequence(roots, tree, r, i)).exp()
            torch.testing.assert_close(tree.draft_probs[r, i], q / q.sum() if q.sum() > 0 else q)
    assert ran_dry  # (some chains ended early)
