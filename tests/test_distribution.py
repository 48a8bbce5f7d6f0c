"""Sampled speculative decoding reproduces the target distribution exactly (chi-square through
the whole engine on a 6-token vocabulary)."""

import itertools

import pytest
import torch
from scipy.stats import chisquare

from specflow import SamplingParams, SpecEngine
from specflow.models import load_model
from specflow.models.random import make_random_checkpoint
from specflow.runtime.model_runner import ModelRunner
from specflow.sampling import SamplingBatch, target_probs

V, PROMPT, NEW = 6, [1, 4, 2, 5], 3  # NEW tokens: one from prefill, then speculative steps
PARAMS = dict(temperature=0.9, top_k=5, top_p=0.95, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    target = make_random_checkpoint(tmp_path_factory.mktemp("v6-target"), hidden_size=32, num_layers=2, num_heads=2,
                                    vocab_size=V, initializer_range=0.15, seed=3, tokenizer=False)
    draft = make_random_checkpoint(tmp_path_factory.mktemp("v6-draft"), hidden_size=32, num_layers=1, num_heads=2,
                                   vocab_size=V, initializer_range=0.15, seed=4, tokenizer=False)
    return target, draft


def exact_joint(model) -> torch.Tensor:
    """[V ** 3] probability p(a) p(b | a) p(c | a, b) of every 3-token continuation under the
    processed target distribution."""
    runner = ModelRunner(model, num_pages=4096)
    sampling = SamplingBatch.from_params([SamplingParams(**PARAMS)], [torch.Generator()])
    joint = torch.zeros(V, V, V, dtype=torch.float64)
    for a, b in itertools.product(range(V), repeat=2):
        logits = runner.extend([0], [PROMPT + [a, b]]).logits  # [len, V]
        runner.release([0])
        p = target_probs(logits[None, len(PROMPT) - 1:], sampling)[0].double()  # [3, V]: p(.), p(.|a), p(.|a,b)
        joint[a, b] = p[0, a] * p[1, b] * p[2]
    return joint.flatten()


def sampled_counts(engine: SpecEngine, n: int) -> torch.Tensor:
    outs = engine.generate([PROMPT] * n, [SamplingParams(seed=i, **PARAMS) for i in range(n)])
    counts = torch.zeros(V ** NEW)
    for o in outs:
        counts[sum(t * V ** (NEW - 1 - i) for i, t in enumerate(o.token_ids))] += 1
    return counts


def assert_same_distribution(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    big = expected >= 5  # pool small cells so the chi-square approximation holds
    obs = torch.cat([counts[big], counts[~big].sum()[None]]).numpy()
    exp = torch.cat([expected[big], expected[~big].sum()[None]]).numpy()
    p = chisquare(obs, exp * obs.sum() / exp.sum()).pvalue
    assert p > 1e-3, f"chi-square p = {p:.2e}"
    return p


CASES = {
    "rejection-sampled-chain": ({"type": "chain", "depth": 2, "sample": True}, {"type": "rejection"}),
    "rejection-topk-eagle2": ({"type": "eagle2", "topk": 2, "depth": 2, "num_draft_tokens": 5}, {"type": "rejection"}),
    "rejection-sampled-static": ({"type": "static", "choices": [[0], [1], [0, 0], [1, 0]], "sample": True},
                                 {"type": "rejection"}),
    "threshold-1-1-eagle2": ({"type": "eagle2", "topk": 2, "depth": 2, "num_draft_tokens": 5},
                             {"type": "threshold", "threshold_single": 1.0, "threshold_acc": 1.0}),
}


@pytest.mark.parametrize("case", ["rejection-sampled-chain", "threshold-1-1-eagle2",
                                  pytest.param("rejection-topk-eagle2", marks=pytest.mark.slow),
                                  pytest.param("rejection-sampled-static", marks=pytest.mark.slow)])
def test_sampled_output_matches_target_distribution(small_vocab, case):
    target, draft = small_vocab
    model = load_model(target)
    tree, verifier = CASES[case]
    engine = SpecEngine(model, {"type": "draft_model", "path": str(draft), "kv_cache_tokens": 8192}, tree, verifier,
                        kv_cache_tokens=8192, max_batch_size=128)
    counts = sampled_counts(engine, 3000)
    assert_same_distribution(counts, exact_joint(model))


def test_the_check_detects_a_lossy_verifier(small_vocab):
    target, draft = small_vocab
    model = load_model(target)
    engine = SpecEngine(model, {"type": "draft_model", "path": str(draft), "kv_cache_tokens": 8192},
                        CASES["threshold-1-1-eagle2"][0], {"type": "threshold", "threshold_single": 0.05},
                        kv_cache_tokens=8192, max_batch_size=128)
    with pytest.raises(AssertionError, match="chi-square"):
        assert_same_distribution(sampled_counts(engine, 3000), exact_joint(model))
