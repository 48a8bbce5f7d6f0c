"""Rejection sampling is lossless: the committed tokens are distributed as the target's.

Each case runs 20k requests through one speculative step (two when the first commits only the
bonus) and compares the counts of the first two committed tokens, over a 5-token vocabulary,
with p(x1) p(x2 | x1) by a chi-square test (fixed seeds). The walk on the device equals the rule
applied one child at a time on the host, given the same coins."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specflow.bench.distribution import chi_square_pvalue
from specflow.sampling import SamplingBatch, SamplingParams, sample_rows, target_probs
from specflow.tree import DraftTree, Expansion
from tests.verifiers.test_greedy import VOCAB, random_trees
from tests.verifiers.oracle import (START, OracleDrafter, PathOracle, first_two_counts,
                                   first_two_probs, make_pair, speculative_step)
from trees.chain import ChainBuilder
from trees.eagle2 import Eagle2Builder
from trees.static import StaticBuilder
from verifiers.greedy import GreedyVerifier
from verifiers.rejection import RejectionVerifier

TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
SAMPLES = 20_000

CASES = {
    "sampled chain (Leviathan)": (ChainBuilder(depth=3, sample=True), SamplingParams(temperature=1.0)),
    "sampled tree (without replacement)": (StaticBuilder(TREE, sample=True), SamplingParams(temperature=1.0)),
    "top-k tree (point mass)": (StaticBuilder(TREE), SamplingParams(temperature=1.0)),
    "eagle2 tree (point mass)": (Eagle2Builder(topk=2, depth=3, num_draft_tokens=6), SamplingParams(temperature=0.7)),
    "sampled tree, top-k and top-p": (StaticBuilder(TREE, sample=True),
                                      SamplingParams(temperature=0.8, top_k=3, top_p=0.9)),
}


@pytest.mark.parametrize("case", CASES)
def test_rejection_sampling_is_lossless(case):
    builder, params = CASES[case]
    target, drafter = make_pair(seed=7)
    counts = first_two_counts(builder, RejectionVerifier(), target, drafter, params, SAMPLES, seed=11)
    assert chi_square_pvalue(counts, first_two_probs(target, params)) > 1e-3


@pytest.mark.parametrize("builder", [ChainBuilder(depth=3, sample=True), StaticBuilder(TREE)],
                         ids=["sampled chain", "top-k tree"])
def test_exact_match_is_lossless_when_sampling(builder):
    """The greedy verifier at temperature > 0 follows the target's own draws (ignoring q)."""
    params = SamplingParams(temperature=0.9, top_p=0.95)
    target, drafter = make_pair(seed=7)
    counts = first_two_counts(builder, GreedyVerifier(), target, drafter, params, SAMPLES, seed=5)
    assert chi_square_pvalue(counts, first_two_probs(target, params)) > 1e-3


def first_tokens_counts(builder, verifier, target: PathOracle, drafter: OracleDrafter, params: SamplingParams,
                        samples: int, seed: int, n: int) -> torch.Tensor:
    """[V ** n] counts of the first n tokens: one speculative step, the rest drawn from the
    processed target itself (so a full acceptance's bonus and the deepest residuals count too)."""
    seeds = [seed * 1_000_003 + r for r in range(samples)]
    committed = speculative_step(builder, verifier, target, drafter, [[START]] * samples, params, seeds)
    rng, cache, v = np.random.default_rng(seed), {}, target.vocab
    counts = torch.zeros(v ** n)
    for toks in committed:
        toks = toks[:n]
        while len(toks) < n:
            if tuple(toks) not in cache:
                cache[tuple(toks)] = target_probs(target.table[[target.code([START, *toks])]][None],
                                                  SamplingBatch.from_params([params], [0]))[0, 0].double().numpy()
            p = cache[tuple(toks)]
            toks = toks + [int(rng.choice(v, p=p / p.sum()))]
        counts[sum(t * v ** (n - 1 - i) for i, t in enumerate(toks))] += 1
    return counts


def first_tokens_probs(target: PathOracle, params: SamplingParams, n: int) -> torch.Tensor:
    """[V ** n] p(x1) p(x2 | x1) ... p(xn | x1 .. xn-1) of the processed target distribution."""
    v, sampling = target.vocab, SamplingBatch.from_params([params], [0])
    joint = torch.ones(1, dtype=torch.float64)
    for k in range(n):
        prefixes = [list(np.unravel_index(i, [v] * k)) if k else [] for i in range(v ** k)]
        rows = target.table[[target.code([START, *map(int, pre)]) for pre in prefixes]][None]
        joint = (joint[:, None] * target_probs(rows, sampling)[0].double()).flatten()
    return joint


@pytest.mark.parametrize("case", ["sampled chain (Leviathan)", "sampled tree (without replacement)",
                                  "eagle2 tree (point mass)"])
def test_rejection_sampling_is_lossless_to_the_deepest_bonus(case):
    """The tests above count the first two committed tokens only: with depth-3 trees a wrong law
    for the drafts below depth 1, the deepest residuals or a full acceptance's bonus went unseen
    (a builder drawing depth >= 2 children from q^4 but recording q passed them; here p < 1e-60)."""
    builder, params = CASES[case]
    target, drafter = make_pair(seed=7)
    counts = first_tokens_counts(builder, RejectionVerifier(), target, drafter, params, SAMPLES, seed=11, n=4)
    probs = first_tokens_probs(target, params, 4)
    assert counts[probs <= 1e-12].sum() == 0, "a sequence the target cannot produce was committed"
    small = probs * SAMPLES < 5  # pooled, so that the chi-square approximation holds
    pooled = lambda x: torch.cat([x[~small], x[small].sum()[None]])  # noqa: E731
    assert chi_square_pvalue(pooled(counts), pooled(probs)) > 1e-3


class HalfMassDrafter(OracleDrafter):
    """Its q is the oracle's top 3 probabilities, not renormalised (rows sum to less than 1)."""

    def expand(self, frontier):
        e = super().expand(frontier)
        if e.probs is None:
            return e
        kth = e.probs.topk(3, dim=-1).values[..., -1:]                     # [B, F, 1]
        return Expansion(e.tokens, e.logprobs, e.probs.masked_fill(e.probs < kth, 0.0))


def test_a_drafter_q_that_does_not_sum_to_one_stays_lossless():
    """Its draws follow the normalised q, so the verifier must divide by that, not by q."""
    params = SamplingParams(temperature=1.0)
    target, drafter = make_pair(seed=7)
    counts = first_two_counts(ChainBuilder(depth=3, sample=True), RejectionVerifier(), target,
                              HalfMassDrafter(drafter.oracle), params, SAMPLES, seed=3)
    assert chi_square_pvalue(counts, first_two_probs(target, params)) > 1e-3


class ScaledQChain(ChainBuilder):
    """A sampled chain whose tree records q x ``scale``: what a builder of its own records when it
    draws with torch.multinomial (which takes weights) and keeps the drafter's q as given, which
    the drafter contract lets sum to anything."""

    def __init__(self, scale: float, **kw):
        super().__init__(**kw)
        self.scale = scale

    def build(self, drafter, roots):
        tree = super().build(drafter, roots)
        tree.draft_probs = tree.draft_probs * self.scale
        return tree


@pytest.mark.parametrize("scale", [0.5, 3.0])
def test_a_tree_q_that_does_not_sum_to_one_is_read_as_its_normalised_law(scale):
    """The drafts were drawn from the normalised q, so the verifier must test them against it,
    whoever recorded q (q x 0.5 accepted too much, chi-square p ~ 1e-197 through the engine)."""
    params = SamplingParams(temperature=1.0)
    target, drafter = make_pair(seed=7)
    counts = first_two_counts(ScaledQChain(scale, depth=3, sample=True), RejectionVerifier(), target, drafter,
                              params, SAMPLES, seed=3)
    assert chi_square_pvalue(counts, first_two_probs(target, params)) > 1e-3


def test_a_drafter_equal_to_the_target_is_always_accepted():
    # q = p: u * q(x) < p(x) for every u < 1, so each step commits all 3 drafts + the bonus
    target = PathOracle(vocab=5, max_len=5, seed=3)
    committed = speculative_step(ChainBuilder(depth=3, sample=True), RejectionVerifier(), target,
                                 OracleDrafter(target), [[0]] * 200, SamplingParams(temperature=1.0),
                                 list(range(200)))
    assert all(len(toks) == 4 for toks in committed)


def test_residual_without_mass_falls_back_to_the_target():
    """q = p but the drafted token has p(x) = 0 (an inconsistent draft): rejected, and
    max(0, p - q) = 0 everywhere, so the bonus comes from p itself."""
    p = torch.tensor([0.0, 0.5, 0.5, 0.0])
    tree = DraftTree(tokens=torch.tensor([[1, 3]]), parents=torch.tensor([[-1, 0]]),
                     depth=torch.tensor([[0, 1]]), positions=torch.tensor([[0, 1]]),
                     scores=torch.ones(1, 2), valid=torch.ones(1, 2, dtype=torch.bool),
                     sampled=torch.tensor([[False, True]]), draft_probs=torch.stack([p, p]).unsqueeze(0)).with_mask()
    logits = p.log().expand(1, 2, 4)  # -inf where p is 0: exactly zero after softmax
    bonus = set()
    for seed in range(20):
        sampling = SamplingBatch.from_params([SamplingParams(temperature=1.0)], [seed])
        verdict = RejectionVerifier().verify(tree, logits, sampling)
        assert verdict.accept_len.tolist() == [0]
        bonus.add(int(verdict.bonus_tokens[0]))
    assert bonus == {1, 2}


def rule_by_hand(tree: DraftTree, probs: np.ndarray, coins: np.ndarray,
                 draws: np.ndarray) -> list[tuple[list[int], int]]:
    """Reference: the class docstring's rule, one request and one child at a time in float64,
    with coin ``coins[b, x]`` for child x and ``draws[b, d]`` for a bonus after depth d: (path,
    bonus) each."""
    def normalised(x, fallback):
        return x / x.sum() if x.sum() > 0 else fallback

    q_all = tree.draft_probs.double().numpy()
    out = []
    for b in range(tree.batch_size):
        node, path = 0, [0]
        p, q = probs[b, 0].copy(), q_all[b, 0].copy()
        while True:
            kids = [c for c in range(1, tree.num_nodes) if tree.valid[b, c] and tree.parents[b, c] == node]
            for c in kids:
                x, sampled = int(tree.tokens[b, c]), bool(tree.sampled[b, c])
                if coins[b, c] * (q[x] if sampled else 1.0) < p[x]:
                    break
                if sampled:
                    p = normalised(np.maximum(p - q, 0.0), probs[b, node])
                    q[x] = 0.0
                    q = normalised(q, q)
                else:
                    p[x] = 0.0
                    p = normalised(p, probs[b, node])
            else:
                break
            node = c
            path.append(node)
            p, q = probs[b, node].copy(), q_all[b, node].copy()
        bonus = sample_rows(torch.from_numpy(p)[None], torch.tensor(draws[b, len(path) - 1:len(path)]))
        out.append((path, int(bonus[0])))
    return out


def most_tries(tree: DraftTree) -> int:
    """Reference ``max_tries``: over every request and valid node x, the children tried to reach x
    (each step: its rank among the valid siblings, plus one) plus x's valid children."""
    most = 0
    for b in range(tree.batch_size):
        kids = {i: [c for c in range(1, tree.num_nodes) if tree.valid[b, c] and tree.parents[b, c] == i]
                for i in range(tree.num_nodes)}
        tries = {0: 0}
        for i in range(tree.num_nodes):  # (parents precede children)
            for rank, c in enumerate(kids[i]):
                tries[c] = tries[i] + rank + 1
        most = max(most, *(t + len(kids[i]) for i, t in tries.items()))
    return most


@settings(max_examples=150, deadline=None)
@given(tree=random_trees(), seed=st.integers(0, 2**16), top_k=st.sampled_from([-1, 2]),
       temperature=st.sampled_from([1.0, 3.0]), all_sampled=st.booleans(), greedy_first=st.booleans(),
       slack=st.sampled_from([None, 0, 3]), bounded=st.booleans())
def test_the_walk_is_the_rule_child_by_child(tree, seed, top_k, temperature, all_sampled, greedy_first, slack,
                                             bounded):
    """Sampled and top-k siblings mixed (or all sampled: rejections that update q), duplicate
    tokens, padding, residuals that run out of mass (top-k zeros), a greedy request among
    sampled ones, depth bounds exact or loose, walks cut at the exact ``max_tries`` bound; coins
    as the verifier draws them: one per node, and the bonus's the draw of its position."""
    b, n = tree.tokens.shape
    if all_sampled:
        tree.sampled = tree.valid & (torch.arange(n) > 0)
    if slack is not None:
        tree.max_depth = int(tree.depth.max()) + slack
    if bounded:
        tree.max_tries = most_tries(tree)
    logits = torch.randn(b, n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2
    params = [SamplingParams(temperature=0.0 if greedy_first and r == 0 else temperature, top_k=top_k)
              for r in range(b)]
    sampling = SamplingBatch.from_params(params, [seed + r for r in range(b)], [seed % 7 + r for r in range(b)])
    coins, draws = sampling.coins(n, "cpu").numpy(), sampling.draws(tree.depth_bound(), "cpu").numpy()
    verdict = RejectionVerifier().verify(tree, logits, sampling)
    assert verdict.accepted.shape == (b, tree.depth_bound() + 1)
    for r, (path, bonus) in enumerate(rule_by_hand(tree, target_probs(logits, sampling).double().numpy(), coins,
                                                   draws)):
        assert verdict.accepted[r, : len(path)].tolist() == path and verdict.accepted[r, len(path):].eq(-1).all()
        assert int(verdict.accept_len[r]) == len(path) - 1
        assert int(verdict.bonus_tokens[r]) == bonus


def test_a_residual_without_mass_after_a_rejected_sibling_falls_back_to_the_node_s_target():
    """The fallback of an empty residual is the node's own p, not the residual left by the
    siblings rejected before (the rule as ``rule_by_hand`` and the docstring read it). p and q are
    exact in binary: child 1 (token 2, p/q = 1/2) is rejected by coin 0.9, leaving p' = q' =
    [.5, .5, 0, 0]; child 2 (token 3, an inconsistent draft: q'(3) = 0) is rejected and
    max(0, p' - q') = 0, so the bonus is drawn from p = [.375, .375, .25, 0]: draw 0.8 is token 2
    (from p' it would be token 1)."""
    p = torch.tensor([0.375, 0.375, 0.25, 0.0])
    q = torch.tensor([0.25, 0.25, 0.5, 0.0])
    tree = DraftTree(tokens=torch.tensor([[0, 2, 3]]), parents=torch.tensor([[-1, 0, 0]]),
                     depth=torch.tensor([[0, 1, 1]]), positions=torch.tensor([[0, 1, 1]]),
                     scores=torch.ones(1, 3), valid=torch.ones(1, 3, dtype=torch.bool),
                     sampled=torch.tensor([[False, True, True]]),
                     draft_probs=torch.stack([q, q, q]).unsqueeze(0)).with_mask()
    probs = p.expand(1, 3, 4).double()
    coins = torch.tensor([[0.0, 0.9, 0.9]], dtype=torch.float64)
    draws = torch.tensor([[0.8, 0.8]], dtype=torch.float64)
    verdict = RejectionVerifier._walk(tree, probs, coins, draws)
    assert verdict.accept_len.tolist() == [0]
    assert verdict.bonus_tokens.tolist() == [2]
    # the reference agrees
    assert rule_by_hand(tree, probs.numpy(), coins.numpy(), draws.numpy()) == [([0], 2)]
