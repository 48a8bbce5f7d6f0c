"""A test drafter answering from a seeded random table indexed by the token path, and the
structural checks every built tree must pass."""

from __future__ import annotations

import zlib

import torch

from specflow.tree import DraftTree, Expansion, Frontier, Roots
from tests.stateless import StatelessDrafter


class TableDrafter(StatelessDrafter):
    """Drafter whose child distribution q(. | sequence) is a seeded random function of the sequence
    (the request's context followed by the draft path), computed once per sequence.

    - ``ties``: logits are small integers, so many children tie exactly.
    - ``max_children``: only a random min_children..max_children tokens may follow a sequence
      (an n-gram drafter's answer); the others get -inf.
    - ``nan_rate``: that fraction of answered log-probs is NaN (a broken drafter).
    """


    def __init__(self, vocab: int, seed: int = 0, ties: bool = False,
                 max_children: int | None = None, min_children: int = 0, nan_rate: float = 0.0):
        self.vocab, self.seed, self.ties = vocab, seed, ties
        self.min_children, self.max_children, self.nan_rate = min_children, max_children, nan_rate
        self._table: dict[tuple[int, ...], torch.Tensor] = {}
        self.calls: list[Frontier] = []

    def logprobs(self, seq: tuple[int, ...]) -> torch.Tensor:
        """log q(. | seq), [V] (-inf where no child may follow)."""
        if seq not in self._table:
            g = torch.Generator().manual_seed(zlib.crc32(repr(seq).encode()) ^ self.seed)
            if self.ties:
                logits = torch.randint(0, 3, (self.vocab,), generator=g).float()
            else:
                logits = torch.randn(self.vocab, generator=g) * 2
            if self.max_children is not None:
                m = int(torch.randint(self.min_children, self.max_children + 1, (), generator=g))
                allowed = torch.randperm(self.vocab, generator=g)[:m]
                logits = torch.full_like(logits, float("-inf")).index_put((allowed,), logits[allowed])
            lp = torch.log_softmax(logits, -1) if torch.isfinite(logits).any() else logits
            self._table[seq] = lp
        return self._table[seq]

    def sequence(self, roots: Roots, tree: DraftTree, b: int, node: int) -> tuple[int, ...]:
        """Context of request b followed by the draft tokens down to ``node`` (root excluded)."""
        path = tree.path_to(b, node)[1:]
        return tuple(roots.contexts[b]) + tuple(tree.tokens[b, path].tolist())

    def expand(self, frontier: Frontier) -> Expansion:
        self.calls.append(frontier)
        b, f = frontier.nodes.shape
        k, v = frontier.k, self.vocab
        tokens = torch.zeros(b, f, k, dtype=torch.long)
        logprobs = torch.full((b, f, k), float("-inf"))
        probs = torch.zeros(b, f, v)
        for r in range(b):
            for c, node in enumerate(frontier.nodes[r].tolist()):
                if node < 0:
                    continue
                lp = self.logprobs(self.sequence(frontier.roots, frontier.tree, r, node))
                top, order = lp.sort(descending=True, stable=True)
                m = min(k, v)
                tokens[r, c, :m], logprobs[r, c, :m] = order[:m], top[:m]
                probs[r, c] = lp.exp()
                if self.nan_rate:
                    g = torch.Generator().manual_seed(node * 7919 + r * 104729 + c + self.seed)
                    hit = torch.rand(k, generator=g) < self.nan_rate
                    logprobs[r, c] = logprobs[r, c].masked_fill(hit, float("nan"))
        return Expansion(tokens, logprobs, probs if frontier.want_probs else None)


def make_roots(batch: int, vocab: int, seed: int = 0, greedy: list[bool] | None = None) -> Roots:
    """B requests with short random contexts, one seeded generator each."""
    g = torch.Generator().manual_seed(seed)
    contexts = [torch.randint(0, vocab, (1 + r % 3,), generator=g).tolist() for r in range(batch)]
    return Roots(
        request_ids=list(range(batch)),
        tokens=torch.tensor([c[-1] for c in contexts]),
        positions=torch.tensor([len(c) - 1 for c in contexts]),
        contexts=contexts,
        generators=[torch.Generator().manual_seed(seed * 1000 + r) for r in range(batch)],
        greedy=None if greedy is None else torch.tensor(greedy),
    )


def check_built_tree(tree: DraftTree, n: int, roots: Roots, drafter: TableDrafter) -> None:
    """Every builder's contract: N nodes, structure, padding, scores = cumulative draft probability."""
    b = roots.batch_size
    assert tree.tokens.shape == (b, n)
    assert tree.mask is not None
    tree.check()  # parents precede children, depth, positions, mask = ancestor sets
    assert torch.equal(tree.tokens[:, 0], roots.tokens) and tree.valid[:, 0].all()
    assert torch.equal(tree.positions[:, 0], roots.positions)  # (then every node's: check())
    torch.testing.assert_close(tree.scores[:, 0], torch.ones(b))
    pad = ~tree.valid
    pad[:, 0] = False
    assert (tree.tokens[pad] == 0).all() and (tree.parents[pad] == 0).all() and (tree.depth[pad] == 1).all()
    assert (tree.scores[pad] == 0).all() and not tree.sampled[pad].any()
    for r in range(b):
        children: dict[int, set[int]] = {}
        for i in range(1, n):
            parent = int(tree.parents[r, i])
            if not tree.valid[r, i]:
                continue
            assert tree.valid[r, parent], "a valid node's parent must be valid"
            token = int(tree.tokens[r, i])
            assert token not in children.setdefault(parent, set()), "siblings must differ"
            children[parent].add(token)
            lp = float(drafter.logprobs(drafter.sequence(roots, tree, r, parent))[token])
            assert lp > float("-inf"), "a valid node must be a child the drafter has"
            expected = float(tree.scores[r, parent]) * min(1.0, torch.tensor(lp).exp().item())
            assert abs(float(tree.scores[r, i]) - expected) <= 1e-5 + 1e-4 * expected
