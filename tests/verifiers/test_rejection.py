"""Rejection sampling is lossless: the committed tokens are distributed as the target's.

Each case runs 20k requests through one speculative step (two when the first commits only the
bonus) and compares the counts of the first two committed tokens, over a 5-token vocabulary,
with p(x1) p(x2 | x1) by a chi-square test (fixed seeds)."""

import pytest
import torch

from specflow.sampling import SamplingBatch, SamplingParams, make_generator
from specflow.tree import DraftTree
from tests.verifiers.oracle import (OracleDrafter, PathOracle, chi_square_pvalue, first_two_counts,
                                   first_two_probs, make_pair, speculative_step)
from trees.chain import ChainBuilder
from trees.eagle2 import Eagle2Builder
from trees.static import StaticBuilder
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


def test_a_drafter_equal_to_the_target_is_always_accepted():
    # q = p: u * q(x) < p(x) for every u < 1, so each step commits all 3 drafts + the bonus
    target = PathOracle(vocab=5, max_len=5, seed=3)
    committed = speculative_step(ChainBuilder(depth=3, sample=True), RejectionVerifier(), target,
                                 OracleDrafter(target), [[0]] * 200, SamplingParams(temperature=1.0),
                                 [make_generator(r) for r in range(200)])
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
        sampling = SamplingBatch.from_params([SamplingParams(temperature=1.0)], [make_generator(seed)])
        verdict = RejectionVerifier().verify(tree, logits, sampling)
        assert verdict.accept_len.tolist() == [0]
        bonus.add(int(verdict.bonus_tokens[0]))
    assert bonus == {1, 2}
