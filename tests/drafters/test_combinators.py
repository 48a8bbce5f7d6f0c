import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from drafters.combinators import FallbackDrafter, UnionDrafter
from drafters.ngram import NgramDrafter
from specflow.config import ConfigError, build_component
from specflow.protocols import Drafter, TargetFeatures, TargetNeeds
from specflow.registry import DRAFTERS
from specflow.tree import Expansion, Frontier, Verdict
from tests.drafters.frontiers import chain_frontier

V = 6


def features(contexts: list[list[int]], taps: list[torch.Tensor] | None = None) -> TargetFeatures:
    return TargetFeatures(
        request_ids=list(range(len(contexts))), tokens=[torch.tensor(c[:-1]) for c in contexts],
        positions=[torch.arange(len(c) - 1) for c in contexts], next_tokens=[c[-1] for c in contexts],
        taps=taps, contexts=[list(c) for c in contexts])


def proposals(expansion: Expansion, b: int, f: int) -> dict[int, float]:
    pairs = zip(expansion.tokens[b, f].tolist(), expansion.logprobs[b, f].tolist())
    return {t: lp for t, lp in pairs if lp > -math.inf}


def ngrams() -> list[NgramDrafter]:
    """Drafters that disagree: long windows only, unigrams only, and a trie shared by requests."""
    return [NgramDrafter(min_window=3, max_window=3, vocab_size=V),
            NgramDrafter(min_window=1, max_window=1, vocab_size=V),
            NgramDrafter(min_window=2, max_window=4, scope="global", vocab_size=V)]


contexts_st = st.lists(st.lists(st.integers(0, V - 1), min_size=1, max_size=24), min_size=1, max_size=3)


@settings(max_examples=40, deadline=None)
@given(contexts_st, st.lists(st.integers(0, V - 1), max_size=3), st.integers(1, V))
def test_union_merges_by_token_with_the_best_logprob(contexts, path, k):
    union = UnionDrafter(ngrams())
    union.begin(features(contexts))
    frontier = chain_frontier(contexts, [path] * len(contexts), k=k, want_probs=True)
    merged = union.expand(frontier)
    # untruncated answers as the reference: the shared trie's tie order moves as lookups touch it
    children = [d.expand(chain_frontier(contexts, [path] * len(contexts), k=V, want_probs=True))
                for d in union.drafters]
    for b in range(len(contexts)):
        for f in range(len(path) + 1):
            best: dict[int, float] = {}
            for e in children:
                for t, lp in proposals(e, b, f).items():
                    best[t] = max(best.get(t, -math.inf), lp)
            got = proposals(merged, b, f)
            assert len(got) == min(k, len(best))  # deduplicated: no token twice
            assert all(best[t] == lp for t, lp in got.items())
            assert merged.logprobs[b, f].tolist() == sorted(merged.logprobs[b, f].tolist(), reverse=True)
            assert sorted(got.values(), reverse=True) == sorted(best.values(), reverse=True)[:k]
            # q: the average of the distributions of the drafters that proposed something here
            rows = [e.probs[b, f] for e in children if e.probs[b, f].sum() > 0]
            expected = torch.stack(rows).mean(0) if rows else torch.zeros(V)
            torch.testing.assert_close(merged.probs[b, f], expected)


@settings(max_examples=40, deadline=None)
@given(contexts_st, st.lists(st.integers(0, V - 1), max_size=3), st.integers(1, V))
def test_fallback_takes_the_first_drafter_with_a_child(contexts, path, k):
    fallback = FallbackDrafter(ngrams())
    fallback.begin(features(contexts))
    frontier = chain_frontier(contexts, [path] * len(contexts), k=k, want_probs=True)
    picked = fallback.expand(frontier)
    children = [d.expand(chain_frontier(contexts, [path] * len(contexts), k=V, want_probs=True))
                for d in fallback.drafters]
    for b in range(len(contexts)):
        for f in range(len(path) + 1):
            first = next((e for e in children if proposals(e, b, f)), children[0])
            assert torch.equal(picked.logprobs[b, f], first.logprobs[b, f, :k])
            assert proposals(picked, b, f).items() <= proposals(first, b, f).items()
            torch.testing.assert_close(picked.probs[b, f], first.probs[b, f])


def test_fallback_reaches_the_next_drafter_only_where_the_first_is_silent():
    context = [1, 2, 3, 1, 2, 3, 4, 2, 3]
    fallback = FallbackDrafter([NgramDrafter(min_window=3, max_window=3), NgramDrafter(min_window=1, max_window=1)])
    fallback.begin(features([context]))
    expansion = fallback.expand(chain_frontier([context], [[1]], k=3))
    # "4 2 3" never occurred before: the unigram drafter answers what followed "3"
    assert proposals(expansion, 0, 0) == pytest.approx({1: math.log(0.5), 4: math.log(0.5)})
    # "2 3 1" occurred: the 3-gram drafter answers alone
    assert proposals(expansion, 0, 1) == {2: 0.0}


def test_lifecycle_reaches_every_drafter():
    shared = NgramDrafter(scope="global")
    union = UnionDrafter([NgramDrafter(), shared])
    union.begin(features([[5, 6, 5]]))
    accepted = [5, 7]
    union.commit(Verdict(accepted=torch.tensor([[0, 1]]), accept_len=torch.tensor([1]),
                         bonus_tokens=torch.tensor([5])),
                 TargetFeatures(request_ids=[0], tokens=[torch.tensor(accepted)],
                                positions=[torch.tensor([2, 3])], next_tokens=[5],
                                contexts=[[5, 6, 5, 7, 5]]))
    assert shared.trie.count([5, 7]) == 1
    union.release([0])
    with pytest.raises(KeyError, match="never begun"):
        union.expand(chain_frontier([[5, 6, 5, 7, 5]], [[]], k=1))


class TapsProbe:
    """A drafter that reads chosen target layer taps, recording what it was given."""

    def __init__(self, layer_taps: tuple[int, ...]):
        self.needs = TargetNeeds(layer_taps=layer_taps)
        self.seen: list[torch.Tensor] | None = None

    def begin(self, features: TargetFeatures) -> None:
        self.seen = features.taps

    def commit(self, verdict: Verdict, features: TargetFeatures) -> None:
        self.seen = features.taps

    def release(self, request_ids: list[int]) -> None:
        self.seen = None

    def expand(self, frontier: Frontier) -> Expansion:
        b, f = frontier.nodes.shape
        return Expansion(tokens=torch.zeros(b, f, frontier.k, dtype=torch.long),
                         logprobs=torch.full((b, f, frontier.k), -math.inf))


def test_needs_are_joined_and_each_drafter_gets_its_own_taps():
    first, second, plain = TapsProbe((2, 5)), TapsProbe((7, 2)), NgramDrafter()
    union = UnionDrafter([first, second, plain])
    assert union.needs == TargetNeeds(layer_taps=(2, 5, 7))
    h = 4
    taps = torch.arange(3 * 3 * h, dtype=torch.float32).view(3, 3 * h)  # [n, taps * H], taps in (2, 5, 7) order
    union.begin(features([[1, 2, 3, 4]], taps=[taps]))
    layer = {t: taps[:, i * h:(i + 1) * h] for i, t in enumerate((2, 5, 7))}
    assert torch.equal(first.seen[0], torch.cat([layer[2], layer[5]], 1))
    assert torch.equal(second.seen[0], torch.cat([layer[7], layer[2]], 1))
    assert isinstance(union, Drafter)


def test_want_probs_needs_every_drafter_to_give_probs():
    fallback = FallbackDrafter([NgramDrafter(vocab_size=V), TapsProbe(())])
    fallback.begin(features([[1, 2, 1]]))
    with pytest.raises(ValueError, match="TapsProbe gave no draft probabilities"):
        fallback.expand(chain_frontier([[1, 2, 1]], [[]], k=1, want_probs=True))


class OneTooFew(TapsProbe):
    """Returns one candidate fewer than the frontier asks for."""

    def expand(self, frontier: Frontier) -> Expansion:
        b, f = frontier.nodes.shape
        return Expansion(tokens=torch.zeros(b, f, frontier.k - 1, dtype=torch.long),
                         logprobs=torch.zeros(b, f, frontier.k - 1))


@pytest.mark.parametrize("kind", [UnionDrafter, FallbackDrafter])
def test_a_child_of_the_wrong_shape_is_named(kind):
    group = kind([NgramDrafter(vocab_size=V), OneTooFew(())])
    group.begin(features([[1, 2, 1]]))
    with pytest.raises(ValueError, match=r"OneTooFew.expand returned tokens of shape \(1, 1, 1\); "
                                         r"expected \[B, F, k\] = \(1, 1, 2\)"):
        group.expand(chain_frontier([[1, 2, 1]], [[]], k=2))


@pytest.mark.parametrize("kind", ["union", "fallback"])
def test_config_errors(kind):
    with pytest.raises(ValueError, match=f"{kind} drafter needs at least one drafter"):
        build_component(DRAFTERS, {"type": kind, "drafters": []})
    with pytest.raises(ConfigError, match=r"drafter.drafters\[1\].*unknown key 'max_windw'"):
        build_component(DRAFTERS, {"type": kind, "drafters": [{"type": "ngram"}, {"type": "ngram", "max_windw": 2}]})
    with pytest.raises(ConfigError, match=r"drafter.drafters\[0\].type: unknown drafter type 'ngarm'"):
        build_component(DRAFTERS, {"type": kind, "drafters": ["ngarm"]})
    built = build_component(DRAFTERS, {"type": kind, "drafters": ["ngram", {"type": "ngram", "scope": "global"}]},
                            vocab_size=V)
    assert [d.scope for d in built.drafters] == ["request", "global"]
    assert all(d.vocab_size == V for d in built.drafters)
    # the shared trie's requests get salted coin walks (SamplingBatch.coin_walk), combined or not
    assert built.learns_across_requests and not build_component(DRAFTERS, {"type": kind, "drafters": ["ngram"]})\
        .learns_across_requests
