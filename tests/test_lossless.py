"""Every drafter x tree x verifier combination that claims losslessness, through the engine:
at temperature 0 the output equals plain greedy decoding token for token, and so does a seeded
sampled output where the verifier follows the target's own draws (exact match)."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specflow import SamplingParams, SpecEngine
from specflow.models import load_model

TREES = {
    "chain": {"type": "chain", "depth": 3},
    "static": {"type": "static", "preset": "mc_sim_7b_63"},
    "eagle2": {"type": "eagle2", "topk": 3, "depth": 3, "num_draft_tokens": 8},
    "bfs": {"type": "bfs", "min_breadth": 1, "max_breadth": 3, "depth": 3, "num_draft_tokens": 8},
}
VERIFIERS = {
    "greedy": {"type": "greedy"},
    "rejection": {"type": "rejection"},
    "threshold": {"type": "threshold", "threshold_single": 1.0, "threshold_acc": 1.0},
    "typical": {"type": "typical"},  # falls back to the greedy walk at temperature 0
}


def drafters(target_path, draft_path):
    return {
        "ngram": {"type": "ngram", "max_window": 3},
        "ngram_global": {"type": "ngram", "scope": "global", "max_window": 2},
        "draft_model": {"type": "draft_model", "path": str(draft_path), "kv_cache_tokens": 2048},
        "self_draft": {"type": "draft_model", "path": str(target_path), "kv_cache_tokens": 2048},
        "union": {"type": "union", "drafters": [{"type": "ngram"}, {"type": "draft_model", "path": str(draft_path),
                                                                     "kv_cache_tokens": 2048}]},
        "fallback": {"type": "fallback", "drafters": [{"type": "ngram"}, {"type": "draft_model", "path": str(draft_path),
                                                                           "kv_cache_tokens": 2048}]},
    }


PROMPTS = [[5, 17, 99, 3, 42, 8, 5, 17, 99, 3], [9, 31, 7, 120, 56], [200, 4, 4, 4, 13, 250, 11, 2, 90, 91, 92, 300]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_target):
    return load_model(tiny_target)


@pytest.fixture(scope="module")
def baseline(model):
    return [o.token_ids for o in SpecEngine(model, kv_cache_tokens=2048).generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("verifier", VERIFIERS)
@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("drafter", ["ngram", "ngram_global", "draft_model", "self_draft", "union", "fallback"])
def test_greedy_equals_plain_decoding(model, tiny_target, tiny_draft, baseline, drafter, tree, verifier):
    engine = SpecEngine(model, drafters(tiny_target, tiny_draft)[drafter], TREES[tree], VERIFIERS[verifier],
                        kv_cache_tokens=2048)
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == baseline
    assert all(sum(o.accept_lengths) == len(o.token_ids) - 1 for o in outs)
    if drafter == "self_draft":  # the target drafting itself is always right
        assert all(max(o.accept_lengths) > 1 for o in outs)
    assert engine.runner.cache.num_pages_used == 0


SAMPLED = [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=20, ignore_eos=True, seed=i) for i in range(3)]


@pytest.fixture(scope="module")
def sampled_baseline(model):
    return [o.token_ids for o in SpecEngine(model, kv_cache_tokens=2048).generate(PROMPTS, SAMPLED)]


@pytest.mark.parametrize("verifier", ["greedy", "rejection"])  # rejection: top-k drafts, so exact match
@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("drafter", ["ngram", "ngram_global", "draft_model", "self_draft", "fallback"])
def test_seeded_sampling_equals_plain_decoding_with_exact_match(model, tiny_target, tiny_draft, sampled_baseline,
                                                                drafter, tree, verifier):
    """Exact match draws each token with the uniform of its position (SamplingBatch.draws), as
    plain decoding does: the same seed gives the same tokens, whatever the drafts (a drafter
    shared between requests salts coin walks only)."""
    engine = SpecEngine(model, drafters(tiny_target, tiny_draft)[drafter], TREES[tree], VERIFIERS[verifier],
                        kv_cache_tokens=2048)
    outs = engine.generate(PROMPTS, SAMPLED)
    assert [o.token_ids for o in outs] == sampled_baseline
    if drafter == "self_draft":  # (the drafts are the target's top-k: some match its draws)
        assert all(max(o.accept_lengths) > 1 for o in outs)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.lists(st.integers(1, 319), min_size=1, max_size=24),
       topk=st.integers(1, 4), depth=st.integers(1, 4), num_draft_tokens=st.integers(2, 12),
       page_size=st.sampled_from([1, 2, 16]), max_tokens=st.integers(1, 16))
def test_random_eagle2_trees_with_draft_model_are_lossless(model, tiny_target, prompt, topk, depth,
                                                           num_draft_tokens, page_size, max_tokens):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    plain = SpecEngine(model, kv_cache_tokens=512, page_size=page_size).generate([prompt], params)[0]
    engine = SpecEngine(model, {"type": "draft_model", "path": str(tiny_target), "kv_cache_tokens": 512,
                                "page_size": page_size},
                        {"type": "eagle2", "topk": topk, "depth": depth, "num_draft_tokens": num_draft_tokens},
                        {"type": "rejection"}, kv_cache_tokens=512, page_size=page_size)
    assert engine.generate([prompt], params)[0].token_ids == plain.token_ids


def test_opt_out_and_batch_policy_keep_outputs(model, tiny_target, baseline):
    node = {"type": "draft_model", "path": str(tiny_target), "kv_cache_tokens": 2048}
    engine = SpecEngine(model, node, TREES["chain"], VERIFIERS["rejection"], kv_cache_tokens=2048,
                        spec_max_batch_size=2)
    mixed = [GREEDY, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, speculative=False), GREEDY]
    outs = engine.generate(PROMPTS, mixed)
    assert [o.token_ids for o in outs] == baseline
    assert outs[1].accept_lengths == [1] * 19  # opted out: one token per step
    # three requests > spec_max_batch_size: speculation is off until the batch shrinks
    assert all(a == 1 for a in outs[0].accept_lengths[:4])
    alone = engine.generate(PROMPTS[:1], GREEDY)[0]
    assert max(alone.accept_lengths) > 1 and alone.token_ids == baseline[0]


def test_stop_string_inside_an_accepted_run_cuts_there(tiny_target):
    engine = SpecEngine(tiny_target, {"type": "draft_model", "path": str(tiny_target), "kv_cache_tokens": 2048},
                        TREES["chain"], VERIFIERS["greedy"], kv_cache_tokens=2048, device="cpu", dtype="float32")
    free = engine.generate("def main():", GREEDY)[0]
    assert max(free.accept_lengths) == 4  # the self-drafter accepts whole chains
    stop = engine.decode(free.token_ids[5:7])
    cut = engine.generate("def main():", SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                                                          stop=[stop]))[0]
    assert cut.text == free.text[: free.text.index(stop)]
    assert cut.token_ids == free.token_ids[: len(cut.token_ids)]
    assert engine.runner.cache.num_pages_used == 0


@pytest.mark.parametrize("tree, verifier", [({"type": "chain", "depth": 3, "sample": True}, "rejection"),
                                            ({"type": "chain", "depth": 3}, "threshold")])
def test_a_request_that_does_not_speculate_decodes_plainly_beside_salted_coin_walks(model, tree, verifier):
    """A drafter shared between requests salts the coin walks of the rows that draft
    (SamplingBatch.coin_walk); a request with speculative=False batched beside them still draws
    with plain decoding's uniforms: the same seed gives plain decoding's tokens."""
    plain = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=7, speculative=False)
    spec = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=8)
    reference = SpecEngine(model, kv_cache_tokens=2048).generate([PROMPTS[0]], plain)[0].token_ids
    engine = SpecEngine(model, {"type": "ngram", "scope": "global"}, tree, {"type": verifier}, kv_cache_tokens=2048)
    assert engine.generate([PROMPTS[0]] * 2, [spec, plain])[1].token_ids == reference
