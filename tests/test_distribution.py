"""Sampled speculative decoding reproduces the target distribution exactly (chi-square through
the whole engine on a 6-token vocabulary)."""

import collections
import itertools
import json
import warnings

import pytest
import torch

from drafters.lookup import draft_paths, ranked_expansion
from specflow import SamplingParams, SpecEngine
from specflow.bench.distribution import (NEW_TOKENS, PARAMS, PROMPT, VOCAB, check_lossless, chi_square_pvalue,
                                         continuation, exact_joint, sampled_counts, small_target)
from specflow.config import build_component
from specflow.models import load_model
from specflow.models.random import make_random_checkpoint
from specflow.protocols import TargetNeeds
from specflow.registry import DRAFTERS
from tests.models.random_heads import eagle3_state, eagle_state, head_hf, medusa_state, write_checkpoint
from tests.test_penalties import reference_logits

V, NEW = VOCAB, NEW_TOKENS
PARAMS_N = dict(PARAMS, max_tokens=NEW, ignore_eos=True)  # a request's SamplingParams


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    target = small_target(tmp_path_factory.mktemp("v6-target"))
    draft = make_random_checkpoint(tmp_path_factory.mktemp("v6-draft"), hidden_size=32, num_layers=1, num_heads=2,
                                   vocab_size=V, initializer_range=0.15, seed=4, tokenizer=False)
    return target, draft


def assert_same_distribution(counts: torch.Tensor, probs: torch.Tensor) -> float:
    p = chi_square_pvalue(counts, probs)
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
    tree, verifier = CASES[case]
    p = check_lossless({"type": "draft_model", "path": str(draft), "kv_cache_tokens": 8192}, tree, verifier, target)
    assert p > 1e-3, f"chi-square p = {p:.2e}"


def test_check_lossless_makes_its_own_small_target():
    """The README's check of a new component: a model-free drafter needs nothing but its nodes."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (the repeating prompt gives the n-gram drafter drafts to test)
        p = check_lossless({"type": "ngram", "max_window": 1}, SAMPLED_STATIC, {"type": "rejection"}, samples=1000,
                           prompt=REPEATING)
    assert p > 1e-3, f"chi-square p = {p:.2e}"


def test_check_lossless_warns_when_it_tested_few_drafts():
    """A drafter that finds (almost) nothing to draft (here: 3-token matches in 7 tokens without
    repeats) leaves a p-value over plain decoding's own draws, which says nothing of its verifier."""
    with pytest.warns(UserWarning, match=r"the verifier tested \d drafts in 200 requests"):
        check_lossless({"type": "ngram", "min_window": 3, "max_window": 3}, {"type": "chain", "depth": 2},
                       {"type": "rejection"}, samples=200)


PENALIZED = dict(PARAMS, repetition_penalty=1.6, frequency_penalty=0.8, presence_penalty=0.5, logit_bias={2: 1.0})


def penalized(logits: torch.Tensor, before: list[int], prompt: list[int] = PROMPT) -> torch.Tensor:
    """The penalties as tests/test_penalties.py writes them out, token by token (exact_joint's adjust)."""
    return torch.tensor(reference_logits(logits.tolist(), prompt, before, SamplingParams(**PENALIZED), set()))


@pytest.mark.parametrize("case", ["rejection-sampled-chain", "threshold-1-1-eagle2",
                                  pytest.param("rejection-topk-eagle2", marks=pytest.mark.slow)])
def test_sampled_output_with_penalties_matches_the_penalized_target_distribution(small_vocab, case):
    """Each node's target distribution depends on its path (the penalties count the path's
    tokens); the drafts do not: a verifier testing them against the path's distribution keeps
    the output exact."""
    target, draft = small_vocab
    model = load_model(target)
    tree, verifier = CASES[case]
    engine = SpecEngine(model, {"type": "draft_model", "path": str(draft), "kv_cache_tokens": 8192}, tree, verifier,
                        kv_cache_tokens=8192, max_batch_size=128)
    joint = exact_joint(model, params=PENALIZED, adjust=penalized)
    assert (joint - exact_joint(model)).abs().sum() > 0.2  # (the penalties move the distribution)
    assert_same_distribution(sampled_counts(engine, 3000, params=PENALIZED), joint)


REPEATING = [5, 1, 3, 1, 4, 5, 2, 3, 0, 5]  # the n-gram drafter finds continuations of its tokens
SAMPLED_STATIC = {"type": "static", "choices": [[0], [1], [0, 0], [0, 1]], "sample": True}


@pytest.mark.slow
def test_sampled_drafts_under_kv_pressure_keep_the_distribution(small_vocab):
    """An n-gram drafter's q has no support below some tokens, so the number of nodes in a sampled
    tree depends on its draws. A pool too small for every tree must turn steps plain before any
    draw: giving up the drawn trees that did not fit biased the output."""
    model = load_model(small_vocab[0])
    engine = SpecEngine(model, {"type": "ngram", "max_window": 1}, SAMPLED_STATIC, {"type": "rejection"},
                        kv_cache_tokens=len(REPEATING) + 5, max_batch_size=1)
    assert_same_distribution(sampled_counts(engine, 3000, REPEATING), exact_joint(model, REPEATING))


def test_a_pool_short_of_full_trees_steps_plainly_before_any_draw(small_vocab):
    """(the fast check of the rule the test above measures)"""
    drafter = build_component(DRAFTERS, {"type": "ngram", "max_window": 1}, vocab_size=V)
    expansions = []
    expand = drafter.expand
    drafter.expand = lambda frontier: expansions.append(frontier) or expand(frontier)
    tree_nodes = len(SAMPLED_STATIC["choices"]) + 1
    for room, drafted in ((tree_nodes - 1, False), (tree_nodes, True)):  # KV slots past the prompt's
        engine = SpecEngine(load_model(small_vocab[0]), drafter, SAMPLED_STATIC, {"type": "rejection"},
                            kv_cache_tokens=len(REPEATING) + room, max_batch_size=1)
        expansions.clear()
        out = engine.generate([REPEATING], SamplingParams(seed=0, **dict(PARAMS_N, max_tokens=2)))[0]
        assert bool(expansions) == drafted and len(out.token_ids) == 2


def test_rows_whose_trees_fit_still_draft_beside_those_that_do_not(small_vocab):
    """Eagerly a tree costs only its own row: two requests run, the pool holds one tree beside
    the other's root (2 x 10 cached + 5 + 1 of 29 slots, not 2 x 15), so the first row drafts
    (its frontiers hold one request) and the second verifies its root."""
    drafter = build_component(DRAFTERS, {"type": "ngram", "max_window": 1}, vocab_size=V)
    asked = []  # (rows in the frontier, requests running)
    tree_nodes = len(SAMPLED_STATIC["choices"]) + 1
    engine = SpecEngine(load_model(small_vocab[0]), drafter, SAMPLED_STATIC, {"type": "rejection"},
                        kv_cache_tokens=2 * len(REPEATING) + tree_nodes + 4, max_batch_size=2)
    expand = drafter.expand
    drafter.expand = lambda f: asked.append((f.nodes.shape[0], len(engine.scheduler.running))) or expand(f)
    engine.generate([REPEATING] * 2, SamplingParams(seed=0, **dict(PARAMS_N, max_tokens=2)))
    assert asked and set(asked) == {(1, 2)}


SHARED_NGRAM = {"type": "ngram", "scope": "global", "max_window": 4}


@pytest.mark.parametrize("tree, verifier", [
    (SAMPLED_STATIC, {"type": "rejection"}),
    (CASES["threshold-1-1-eagle2"][0], {"type": "threshold"}),
])
def test_requests_of_one_seed_stay_lossless_with_a_drafter_shared_between_them(small_vocab, tree, verifier):
    """A trie shared by all requests drafts each of 36 prompts (distinct tails, so a window finds
    its own prompt's history) the tokens that an earlier request of the same seed drew with the
    uniforms of this request's coin walk; the walk must key its coins and draws apart (salts:
    unsalted, chi-square p ~ 1e-14 for rejection and 1e-24 for threshold over these 2160 pairs)."""
    model = load_model(small_vocab[0])
    prompts = [REPEATING + list(tail) for tail in itertools.product(range(V), repeat=2)]
    counts = torch.zeros(V ** NEW)
    for r in range(60):  # a fresh trie for every round of 36 pairs
        engine = SpecEngine(model, SHARED_NGRAM, tree, verifier, kv_cache_tokens=4096, max_batch_size=64)
        params = [SamplingParams(seed=r * len(prompts) + i, **PARAMS_N) for i in range(len(prompts))]
        engine.generate(prompts, params)   # the earlier requests, feeding the trie
        for o in engine.generate(prompts, params):
            counts[continuation(o.token_ids, V)] += 1
    assert_same_distribution(counts, sum(exact_joint(model, prompt) for prompt in prompts))


@pytest.fixture(scope="module")
def small_heads(small_vocab, tmp_path_factory):
    """Drafter nodes over the 6-token target: the draft model, random EAGLE, EAGLE-3 (the
    2-layer target's taps 0, 1, 1) and Medusa heads, and the combinators of the n-gram drafter
    and the draft model."""
    target, draft = small_vocab
    config = load_model(target).config
    hf = head_hf(config)
    hf3 = head_hf(config, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=V,
                  eagle_aux_hidden_state_layer_ids=[0, 1, 1])
    eagle = write_checkpoint(tmp_path_factory.mktemp("v6-eagle"), hf, eagle_state(hf, seed=1), "safetensors")
    eagle3 = write_checkpoint(tmp_path_factory.mktemp("v6-eagle3"), hf3, eagle3_state(hf3, seed=2), "safetensors")
    medusa = write_checkpoint(tmp_path_factory.mktemp("v6-medusa"), {"medusa_num_heads": 2, "medusa_num_layers": 1},
                              medusa_state(config.hidden_size, V, num_heads=2, seed=5), "safetensors")
    model_node = {"type": "draft_model", "path": str(draft), "kv_cache_tokens": 8192}
    return {"ngram": {"type": "ngram", "max_window": 2}, "draft_model": model_node,
            "union": {"type": "union", "drafters": [{"type": "ngram", "max_window": 2}, model_node]},
            "fallback": {"type": "fallback", "drafters": [{"type": "ngram", "max_window": 2}, model_node]},
            "eagle": {"type": "eagle", "path": str(eagle), "kv_cache_tokens": 8192},
            "eagle3": {"type": "eagle3", "path": str(eagle3), "kv_cache_tokens": 8192},
            "medusa": {"type": "medusa", "path": str(medusa)}}


SAMPLED_TREE = {"type": "static", "choices": [[0], [1], [0, 0], [0, 1], [1, 0]], "sample": True}


@pytest.mark.parametrize("drafter", ["ngram", "union", "fallback", "eagle", "eagle3", "medusa"])
def test_every_drafter_s_q_keeps_the_distribution_under_rejection_over_sampled_drafts(small_vocab, small_heads,
                                                                                      drafter):
    """Each drafter's q (a lookup's counts, a mixture, another drafter's answer, a head's
    softmax, EAGLE-3's draft vocabulary mapped to the target's) is what a sampled tree draws
    from and what the verifier corrects with (the draft model: CASES above)."""
    p = check_lossless(small_heads[drafter], SAMPLED_TREE, {"type": "rejection"}, small_vocab[0], prompt=REPEATING)
    assert p > 1e-3, f"chi-square p = {p:.2e}"


@pytest.fixture(scope="module")
def restricted_heads(small_vocab, small_heads, tmp_path_factory):
    """Heads that draft among 3 of the 6 target tokens: EAGLE with an FR-Spec token map and
    EAGLE-3 with a 3-token draft vocabulary (d2t / t2d); q has no mass on the other tokens."""
    config = load_model(small_vocab[0]).config
    hot = torch.tensor([4, 0, 2])
    hf3 = head_hf(config, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=len(hot),
                  eagle_aux_hidden_state_layer_ids=[0, 1, 1])
    eagle3 = write_checkpoint(tmp_path_factory.mktemp("v6-eagle3-hot"), hf3, eagle3_state(hf3, seed=3, hot=hot),
                              "safetensors")
    token_map = tmp_path_factory.mktemp("v6-hot") / "hot.json"
    token_map.write_text(json.dumps(hot.tolist()))
    return {"eagle-token-map": dict(small_heads["eagle"], token_map=str(token_map)),
            "eagle3-draft-vocab": {"type": "eagle3", "path": str(eagle3), "kv_cache_tokens": 8192}}


@pytest.mark.parametrize("tree, verifier", [(SAMPLED_TREE, {"type": "rejection"}),
                                            (CASES["threshold-1-1-eagle2"][0], {"type": "threshold"})],
                         ids=["rejection-sampled-static", "threshold-1-1-eagle2"])
@pytest.mark.parametrize("drafter", ["eagle-token-map", "eagle3-draft-vocab"])
def test_drafts_among_a_subset_of_the_vocabulary_keep_the_distribution(small_vocab, restricted_heads, drafter, tree,
                                                                       verifier):
    """A residual max(p - q, 0) keeps all of p's mass on the tokens q cannot draft: the target's
    law whatever part of the vocabulary the head drafts from."""
    p = check_lossless(restricted_heads[drafter], tree, verifier, small_vocab[0], prompt=REPEATING)
    assert p > 1e-3, f"chi-square p = {p:.2e}"


@pytest.mark.parametrize("drafter", ["ngram", "union", "eagle"])
def test_sampled_trees_of_every_drafter_kind_keep_the_penalized_distribution(small_vocab, small_heads, drafter):
    """Penalties over a sampled tree: q (a lookup's counts, a mixture, a head's softmax) knows no
    penalties, p at each node counts its path's tokens and the prompt's (repeats in it)."""
    model = load_model(small_vocab[0])
    engine = SpecEngine(model, small_heads[drafter], SAMPLED_TREE, {"type": "rejection"}, kv_cache_tokens=8192,
                        max_batch_size=128)
    tested = []
    counts = sampled_counts(engine, 3000, REPEATING, params=PENALIZED, tested=tested)
    assert sum(tested) > 3000  # (the verifier tested drafts in most requests)
    assert_same_distribution(counts, exact_joint(model, REPEATING, params=PENALIZED,
                                                 adjust=lambda logits, before: penalized(logits, before, REPEATING)))


THRESHOLD_TREES = {"chain": {"type": "chain", "depth": 2}, "static": dict(SAMPLED_TREE, sample=False),
                   "bfs": {"type": "bfs", "min_breadth": 1, "max_breadth": 2, "depth": 2, "num_draft_tokens": 5},
                   "sampled-static": SAMPLED_TREE}


@pytest.mark.parametrize("tree", THRESHOLD_TREES)
def test_threshold_1_1_keeps_the_distribution_on_every_tree(small_vocab, small_heads, tree):
    """Thresholds of 1 treat every draft as a point mass, whoever chose it: top-k picks of any
    builder, or draws from q without replacement (eagle2: CASES above)."""
    p = check_lossless(small_heads["draft_model"], THRESHOLD_TREES[tree], {"type": "threshold"}, small_vocab[0],
                       prompt=REPEATING)
    assert p > 1e-3, f"chi-square p = {p:.2e}"


COIN_WALKS = {"rejection-sampled-chain": CASES["rejection-sampled-chain"],
              "threshold-1-1-eagle2": CASES["threshold-1-1-eagle2"]}
SETTINGS = {"pages-of-4": dict(page_size=4), "graphs": dict(cuda_graphs=True), "prefix-caching": dict(prefix_caching=True),
            "chunked-prefill": dict(max_prefill_tokens=3)}


@pytest.mark.parametrize("walk", COIN_WALKS)
@pytest.mark.parametrize("drafter", ["draft_model", "eagle"])
def test_coin_walks_commit_the_same_tokens_whatever_the_engine_settings(small_vocab, small_heads, drafter, walk):
    """A coin walk's output is fixed by the seed given the trees drafted, and pages, the padded
    static CUDA-graph path, prefix caching and chunked prefill draft the same trees: the
    tests above measure these outputs' distribution in the default engine."""
    model = load_model(small_vocab[0])
    tree, verifier = COIN_WALKS[walk]
    params = [SamplingParams(seed=i, **dict(PARAMS_N, max_tokens=8)) for i in range(48)]

    def outputs(**settings):
        engine = SpecEngine(model, small_heads[drafter], tree, verifier, kv_cache_tokens=4096, max_batch_size=16,
                            **settings)
        return [o.token_ids for o in engine.generate([REPEATING] * len(params), params)]

    default = outputs()
    assert all(outputs(**SETTINGS[name]) == default for name in SETTINGS)


@pytest.mark.parametrize("walk", COIN_WALKS)
def test_sampled_drafts_keep_the_distribution_where_speculation_pauses(small_vocab, small_heads, walk):
    """Requests that speculate alone, then step plainly once others join past
    spec_max_batch_size (a drafted step, then plain steps launched ahead, within the three
    tokens counted)."""
    model = load_model(small_vocab[0])
    tree, verifier = COIN_WALKS[walk]
    tree = dict(tree, depth=1) if tree["type"] == "chain" else dict(tree, depth=1, num_draft_tokens=3)
    group = 16
    engine = SpecEngine(model, small_heads["draft_model"], tree, verifier, kv_cache_tokens=8192,
                        max_batch_size=2 * group, spec_max_batch_size=group)
    counts, switched = torch.zeros(V ** NEW), 0
    for g in range(3000 // group):
        counted = {engine.add_request(PROMPT, SamplingParams(seed=2 * group * g + i, **PARAMS_N)) for i in range(group)}
        outs = engine.step()  # their prefill and a drafted step
        for i in range(group):  # others join: plain steps from here
            engine.add_request(PROMPT, SamplingParams(seed=2 * group * g + group + i, **dict(PARAMS_N, max_tokens=2)))
        while engine.has_unfinished():
            outs += engine.step()
        for o in outs:
            if o.request_id in counted:
                counts[continuation(o.token_ids, V)] += 1
                switched += len(o.tried_depths) > 1 and o.tried_depths[-1] == 0
    assert switched > 500  # (requests whose drafted step left them a token to draw plainly)
    assert_same_distribution(counts, exact_joint(model))


@pytest.mark.parametrize("walk", COIN_WALKS)
def test_sampled_drafts_keep_the_distribution_beside_requests_of_other_parameters(small_vocab, small_heads, walk):
    """Each counted request shares its steps with one of other sampling parameters (greedy, a
    hotter or colder temperature, top-k 2, min-p, another prompt and length): no row's
    acceptance or draws may depend on its batch-mates'."""
    model = load_model(small_vocab[0])
    tree, verifier = COIN_WALKS[walk]
    engine = SpecEngine(model, small_heads["draft_model"], tree, verifier, kv_cache_tokens=8192, max_batch_size=128)
    others = [dict(temperature=0.0), dict(temperature=1.3), dict(temperature=0.7, top_k=2),
              dict(temperature=1.0, min_p=0.2), dict(temperature=0.5, top_p=0.5)]
    prompts, params = [], []
    for i in range(3000):
        prompts += [PROMPT, REPEATING[:3 + i % 7]]
        params += [SamplingParams(seed=i, **PARAMS_N),
                   SamplingParams(seed=10**6 + i, max_tokens=1 + i % 5, ignore_eos=True, **others[i % 5])]
    counts = torch.zeros(V ** NEW)
    for o in engine.generate(prompts, params)[::2]:
        counts[continuation(o.token_ids, V)] += 1
    assert_same_distribution(counts, exact_joint(model))


class SharedCounts:
    """A drafter that learns across requests: q(. | context) = (1 + how often each token followed
    this very context in any request before) / total."""

    needs = TargetNeeds()
    learns_across_requests = True

    def __init__(self):
        self.seen: dict[tuple[int, ...], collections.Counter] = collections.defaultdict(collections.Counter)
        self.counted: dict[int, int] = {}  # request id -> its committed ids already counted

    def begin(self, features): self.commit(None, features)
    def release(self, request_ids): pass

    def commit(self, verdict, features):
        for rid, ids in zip(features.request_ids, features.contexts):
            for i in range(max(1, self.counted.get(rid, 0)), len(ids)):
                self.seen[tuple(ids[:i])][ids[i]] += 1
            self.counted[rid] = len(ids)

    def expand(self, frontier):
        answers = [[[] if path is None else sorted(((t, 1 + seen[t]) for t in range(V)), key=lambda x: -x[1])
                    for path in paths for seen in [self.seen[tuple(frontier.roots.contexts[b] + path)]]]
                   for b, paths in enumerate(draft_paths(frontier))]
        return ranked_expansion(answers, frontier, V)


def test_requests_of_one_seed_draw_their_sampled_drafts_apart_with_a_drafter_shared_between_them(small_vocab):
    """Sampled drafts come from the request's generator: with a drafter that learns across
    requests, an earlier request of the same seed drew its drafts with the noise this request
    draws with, and its tokens are this request's q. Unkeyed: chi-square p = 1.6e-13 over these
    5760 pairs (first two tokens)."""
    model = load_model(small_vocab[0])
    prompts = [REPEATING + list(tail) for tail in itertools.product(range(V), repeat=2)]
    counts = torch.zeros(V ** NEW)
    for r in range(160):
        engine = SpecEngine(model, SharedCounts(), {"type": "chain", "depth": 1, "sample": True}, {"type": "rejection"},
                            kv_cache_tokens=4096, max_batch_size=64)
        params = [SamplingParams(seed=r * len(prompts) + i, **PARAMS_N) for i in range(len(prompts))]
        # (the earlier requests run past the later ones: a request's last step is never committed)
        engine.generate(prompts, [SamplingParams(seed=p.seed, **dict(PARAMS_N, max_tokens=NEW + 3)) for p in params])
        for o in engine.generate(prompts, params):
            counts[continuation(o.token_ids, V)] += 1
    def first_two(joint: torch.Tensor) -> torch.Tensor:  # (the first draft's token is the second)
        return joint.view(V, V, V).sum(-1).flatten()

    assert_same_distribution(first_two(counts), first_two(sum(exact_joint(model, prompt) for prompt in prompts)))


def test_a_drafter_shared_between_requests_keys_their_draft_generators_apart(small_vocab):
    """(the fast check of the rule the test above measures) Same seed: the same draws for a drafter
    of one request, other draws for a drafter that learns across requests."""
    for drafter, apart in (({"type": "ngram"}, False), (SHARED_NGRAM, True)):
        engine = SpecEngine(load_model(small_vocab[0]), drafter, SAMPLED_STATIC, {"type": "rejection"})
        a, b = (engine._requests[engine.add_request(PROMPT, SamplingParams(seed=5, **PARAMS_N))] for _ in range(2))
        assert torch.equal(torch.rand(8, generator=a.generator), torch.rand(8, generator=b.generator)) != apart


def test_the_check_detects_a_lossy_verifier(small_vocab):
    target, draft = small_vocab
    assert check_lossless({"type": "draft_model", "path": str(draft), "kv_cache_tokens": 8192},
                          CASES["threshold-1-1-eagle2"][0], {"type": "threshold", "threshold_single": 0.05},
                          target) < 1e-6


def test_chi_square_pvalue_is_scipy_s_and_a_count_the_law_cannot_have_is_p_0():
    from scipy.stats import chisquare

    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    counts = torch.tensor([260.0, 280.0, 140.0, 20.0, 0.0])
    expected = probs[:4] * counts.sum()
    assert chi_square_pvalue(counts, probs) == pytest.approx(chisquare(counts[:4].numpy(), expected.numpy()).pvalue)
    assert chi_square_pvalue(counts + torch.tensor([0, 0, 0, 0, 1.0]), probs) == 0.0
    pooled = chi_square_pvalue(torch.tensor([50.0, 46.0, 3.0, 1.0]), torch.tensor([0.5, 0.46, 0.03, 0.01]))
    assert pooled == pytest.approx(chisquare([50, 46, 4], [50, 46, 4]).pvalue)  # the last two cells pooled


def test_engines_sharing_a_learning_drafter_salt_their_requests_apart(small_vocab):
    """Request ids start at 0 in every engine: salts keyed by them gave request i of a second
    engine over the same global trie request i of the first one's coins (the test above, with the
    trie warmed by another engine: chi-square p ~ 2e-14)."""
    model = load_model(small_vocab[0])
    shared = build_component(DRAFTERS, SHARED_NGRAM, vocab_size=V)
    salts = set()
    for _ in range(2):
        engine = SpecEngine(model, shared, SAMPLED_STATIC, {"type": "rejection"})
        salts.add(engine._requests[engine.add_request(PROMPT, SamplingParams(seed=5, **PARAMS_N))].salt)
    assert len(salts) == 2 and 0 not in salts
    fresh = [SpecEngine(model, build_component(DRAFTERS, SHARED_NGRAM, vocab_size=V), SAMPLED_STATIC,
                        {"type": "rejection"}) for _ in range(2)]
    # a drafter of its own: the same salts in every engine, so a seeded run repeats in one process
    assert len({e._requests[e.add_request(PROMPT, SamplingParams(seed=5, **PARAMS_N))].salt for e in fresh}) == 1
