"""SGLang's thresholded verifier: lossless at 1.0 / 1.0 (chi-square on the first two committed
tokens, as in test_rejection), and visibly lossy below; the same test must catch that."""

import pytest

from specflow.config import build_component
from specflow.registry import VERIFIERS
from specflow.sampling import SamplingParams
from tests.verifiers.oracle import chi_square_pvalue, first_two_counts, first_two_probs, make_pair
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
