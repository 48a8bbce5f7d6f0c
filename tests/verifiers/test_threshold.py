"""SGLang's thresholded verifier: lossless at 1.0 / 1.0 (chi-square on the first two committed
tokens, as in test_rejection), and visibly lossy below; the same test must catch that. Its walk
on the device equals SGLang's sequential scan given the same coins."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specflow.bench.distribution import chi_square_pvalue
from specflow.config import build_component
from specflow.registry import VERIFIERS
from specflow.sampling import SamplingBatch, SamplingParams, sample_rows, target_probs
from specflow.tree import DraftTree
from tests.verifiers.oracle import first_two_counts, first_two_probs, make_pair
from tests.verifiers.test_greedy import VOCAB, random_trees
from trees.static import StaticBuilder
from verifiers.threshold import ThresholdVerifier

TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
SAMPLES = 20_000


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.8, top_k=3, top_p=0.9)],
                         ids=["plain", "top-k-top-p"])
def test_thresholds_of_one_are_lossless(params):
    target, drafter = make_pair(seed=7)
    counts = first_two_counts(StaticBuilder(TREE), ThresholdVerifier(), target, drafter, params, SAMPLES, seed=13)
    assert chi_square_pvalue(counts, first_two_probs(target, params)) > 1e-3


def test_a_low_single_threshold_is_detected_as_lossy():
    """Negative control: accepting every draft with p(x) >= 0.3 skews the output; the
    chi-square test must reject it decisively."""
    params = SamplingParams(temperature=1.0)
    target, drafter = make_pair(seed=7)
    verifier = ThresholdVerifier(threshold_single=0.3)
    assert not verifier.lossless
    counts = first_two_counts(StaticBuilder(TREE), verifier, target, drafter, params, SAMPLES, seed=13)
    assert chi_square_pvalue(counts, first_two_probs(target, params)) < 1e-6


def test_lossless_only_at_one_and_one():
    assert ThresholdVerifier().lossless
    assert not ThresholdVerifier(threshold_acc=0.5).lossless
    assert ThresholdVerifier(threshold_acc=0.0).threshold_acc == 1e-9  # clamped, as SGLang
    verifier = build_component(VERIFIERS, {"type": "threshold", "threshold_single": 0.8})
    assert (verifier.threshold_single, verifier.lossless) == (0.8, False)


@pytest.mark.parametrize("kwargs, match", [
    ({"threshold_single": 0.0}, "threshold_single"), ({"threshold_single": 1.5}, "threshold_single"),
    ({"threshold_acc": -0.1}, "threshold_acc"), ({"threshold_acc": 2.0}, "threshold_acc"),
])
def test_bad_thresholds(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ThresholdVerifier(**kwargs)


def sequential_scan(tree: DraftTree, probs: torch.Tensor, coins: torch.Tensor, draws: torch.Tensor, single: float,
                    acc: float) -> list[tuple[list[int], int]]:
    """Reference: SGLang's scan, one request and one child at a time, with coin ``coins[b, node]``
    at each visited node and ``draws[b, d]`` for a bonus after depth d: (accepted path, bonus)
    per request."""
    out = []
    for b in range(tree.batch_size):
        node, path = 0, [0]
        while True:
            kids = [c for c in range(1, tree.num_nodes) if tree.valid[b, c] and tree.parents[b, c] == node]
            prob_acc, zeroed, accepted = 0.0, set(), None
            for c in kids:
                x = int(tree.tokens[b, c])
                px = 0.0 if x in zeroed else float(probs[b, node, x])
                prob_acc += px
                if float(coins[b, node]) < prob_acc / acc or px >= single:
                    accepted = c
                    break
                zeroed.add(x)
            if accepted is None:
                break
            node = accepted
            path.append(node)
        row = probs[b, node].clone()
        row[list(zeroed)] = 0.0
        row = row if row.sum() > 0 else probs[b, node]
        out.append((path, int(sample_rows(row[None], draws[b, len(path) - 1:len(path)])[0])))
    return out


@settings(max_examples=60, deadline=None)
@given(tree=random_trees(), seed=st.integers(0, 2**16), single=st.sampled_from([1.0, 0.4]),
       acc=st.sampled_from([1.0, 0.5]), temperature=st.sampled_from([1.0, 3.0]))
def test_the_walk_is_the_sequential_scan(tree, seed, single, acc, temperature):
    """Padding, duplicate sibling tokens (zeroed once rejected) and both thresholds; coins as
    the verifier draws them: one per node, and the bonus's the draw of its position."""
    b, n = tree.tokens.shape
    logits = torch.randn(b, n, VOCAB, generator=torch.Generator().manual_seed(seed))
    sampling = SamplingBatch.from_params([SamplingParams(temperature=temperature)] * b,
                                         [seed + r for r in range(b)], [seed % 5 + 3 * r for r in range(b)])
    coins, draws = sampling.coins(n, "cpu"), sampling.draws(tree.depth_bound(), "cpu")
    verdict = ThresholdVerifier(single, acc).verify(tree, logits, sampling)
    for r, (path, bonus) in enumerate(sequential_scan(tree, target_probs(logits, sampling), coins, draws,
                                                      single, acc)):
        assert verdict.accepted_nodes(r) == path
        assert int(verdict.bonus_tokens[r]) == bonus
