import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from drafters.ngram import NgramDrafter, SuffixTrie
from specflow.config import ConfigError, build_component
from specflow.protocols import Drafter, TargetFeatures
from specflow.registry import DRAFTERS
from specflow.tree import Verdict
from tests.drafters.frontiers import chain_frontier

V = 6


def begin(drafter, contexts: list[list[int]]) -> None:
    drafter.begin(TargetFeatures(
        request_ids=list(range(len(contexts))), tokens=[torch.tensor(c[:-1]) for c in contexts],
        positions=[torch.arange(len(c) - 1) for c in contexts], next_tokens=[c[-1] for c in contexts],
        contexts=[list(c) for c in contexts]))


def commit(drafter, rid: int, old: list[int], new: list[int]) -> None:
    """Commit the tokens that extend ``old`` to ``new`` (accepted path from the old root + bonus)."""
    accepted = new[len(old) - 1:-1]
    verdict = Verdict(accepted=torch.arange(len(accepted))[None], accept_len=torch.tensor([len(accepted) - 1]),
                      bonus_tokens=torch.tensor([new[-1]]))
    drafter.commit(verdict, TargetFeatures(
        request_ids=[rid], tokens=[torch.tensor(accepted)], positions=[torch.arange(len(old) - 1, len(new) - 1)],
        next_tokens=[new[-1]], contexts=[list(new)]))


def reference(searched: list[list[int]], full: list[int], min_window: int, max_window: int) -> dict:
    """Brute force: {follower: (count, last position)} of the longest suffix of ``full`` (max..min)
    that occurs, followed by a token, in one of the ``searched`` sequences."""
    for n in range(max_window, min_window - 1, -1):
        if n > len(full):
            continue
        key, found = full[-n:], {}
        for seq in searched:
            for p in range(n, len(seq)):
                if seq[p - n:p] == key:
                    found[seq[p]] = (found.get(seq[p], (0, 0))[0] + 1, p)
        if found:
            return found
    return {}


def answers(expansion, b: int, f: int) -> list[tuple[int, float]]:
    tokens, logprobs = expansion.tokens[b, f].tolist(), expansion.logprobs[b, f].tolist()
    return [(t, lp) for t, lp in zip(tokens, logprobs) if lp > -math.inf]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=40), st.lists(st.integers(0, 3), max_size=4),
       st.integers(1, 3), st.integers(0, 2), st.lists(st.integers(1, 6), max_size=4), st.integers(1, 5))
def test_request_scope_matches_brute_force_scan(context, path, min_window, extra, chunks, k):
    """Children = followers of the longest matching suffix of context + path, counts and order exact,
    whether the context arrived at begin or in later commits."""
    drafter = NgramDrafter(min_window=min_window, max_window=min_window + extra, vocab_size=V)
    cut = max(1, len(context) - sum(chunks))
    begin(drafter, [context[:cut]])
    committed = context[:cut]
    for size in chunks:
        if len(committed) < len(context):
            new = context[:len(committed) + size]
            commit(drafter, 0, committed, new)
            committed = new
    expansion = drafter.expand(chain_frontier([context], [path], k=k, want_probs=True))
    for depth in range(len(path) + 1):
        full = context + path[:depth]
        found = reference([full], full, min_window, min_window + extra)
        total = sum(c for c, _ in found.values())
        ranked = sorted(found, key=lambda t: (-found[t][0], -found[t][1]))[:k]
        got = answers(expansion, 0, depth)
        assert [t for t, _ in got] == ranked
        assert [lp for _, lp in got] == pytest.approx([math.log(found[t][0] / total) for t in ranked])
        q = torch.zeros(V)
        for t, (c, _) in found.items():
            q[t] = c / total
        torch.testing.assert_close(expansion.probs[0, depth], q)


@pytest.mark.parametrize("scope", ["request", "global"])
def test_paths_below_the_root_are_honoured(scope):
    context = [1, 2, 3, 9, 1, 2, 4, 9, 1]
    drafter = NgramDrafter(max_window=3, scope=scope)
    begin(drafter, [context])
    expansion = drafter.expand(chain_frontier([context], [[2, 3]], k=2))
    assert answers(expansion, 0, 0) == [(2, 0.0)]  # ... 9 1 -> 2
    assert answers(expansion, 0, 1) == [(4, 0.0)]  # ... 9 1 2 -> 4 (not 3: the 3-gram wins)
    assert answers(expansion, 0, 2) == [(9, 0.0)]  # ... 1 2 3 -> 9, read through the path


def test_global_scope_shares_continuations_between_requests():
    a, b = [1, 2, 3, 4, 5], [9, 2, 3]
    shared = NgramDrafter(scope="global")
    own = NgramDrafter(scope="request")
    for drafter in (shared, own):
        begin(drafter, [a, b])
    assert answers(shared.expand(chain_frontier([a, b], [[], []], k=2)), 1, 0) == [(4, 0.0)]
    assert answers(own.expand(chain_frontier([a, b], [[], []], k=2)), 1, 0) == []
    # what request 0 commits later drafts for request 1 as well
    commit(shared, 0, a, a + [2, 3, 7])
    got = dict(answers(shared.expand(chain_frontier([a + [2, 3, 7], b], [[], []], k=2)), 1, 0))
    assert got == pytest.approx({4: math.log(1 / 2), 7: math.log(1 / 2)})


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=20), min_size=1, max_size=3),
       st.lists(st.integers(0, 3), max_size=3), st.integers(1, 3))
def test_global_scope_counts_every_request_context(contexts, path, max_window):
    """Without eviction the trie answers like a brute-force scan over all committed contexts."""
    drafter = NgramDrafter(min_window=1, max_window=max_window, scope="global", vocab_size=V)
    begin(drafter, contexts)
    paths = [path] * len(contexts)
    expansion = drafter.expand(chain_frontier(contexts, paths, k=V, want_probs=True))
    for b, ctx in enumerate(contexts):
        for depth in range(len(path) + 1):
            found = reference(contexts, ctx + path[:depth], 1, max_window)
            total = sum(c for c, _ in found.values())
            q = torch.zeros(V)
            for t, (c, _) in found.items():
                q[t] = c / total
            torch.testing.assert_close(expansion.probs[b, depth], q)
            assert len(answers(expansion, b, depth)) == len(found)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 4), min_size=1, max_size=12), st.integers(0, 12)),
                min_size=1, max_size=8),
       st.integers(1, 12), st.integers(1, 5))
def test_trie_capacity_is_never_exceeded(inserts, capacity, branch_length):
    trie = SuffixTrie(branch_length=branch_length, capacity=capacity)
    for tokens, new_from in inserts:
        trie.insert(tokens, new_from=min(new_from, len(tokens)))
        trie.followers(tokens[-2:])
        assert len(trie) <= capacity
        trie.check()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 2), min_size=1, max_size=25), st.lists(st.integers(1, 5), max_size=6),
       st.integers(1, 4))
def test_trie_counts_each_occurrence_once_across_incremental_inserts(tokens, chunks, branch_length):
    trie = SuffixTrie(branch_length=branch_length, capacity=10_000)
    done = 0
    for end in [*(sum(chunks[:i + 1]) for i in range(len(chunks))), len(tokens)]:
        end = min(end, len(tokens))
        trie.insert(tokens[:end], new_from=done)
        done = max(done, end)
    for i in range(len(tokens)):
        for n in range(1, branch_length + 1):
            s = tokens[i:i + n]
            expected = sum(tokens[j:j + len(s)] == s for j in range(len(tokens) - len(s) + 1))
            assert trie.count(s) == expected


def test_trie_evicts_least_recently_touched_leaf():
    trie = SuffixTrie(branch_length=1, capacity=3)
    trie.insert([1, 2, 3], new_from=0)
    trie.insert([1], new_from=0)       # touch 1: now 2 is the oldest
    trie.insert([4], new_from=0)
    assert [trie.count([t]) for t in (1, 2, 3, 4)] == [2, 0, 1, 1]

    trie = SuffixTrie(branch_length=2, capacity=3)
    trie.insert([1, 2], new_from=0)    # nodes 1, 1->2, 2
    trie.insert([7], new_from=0)       # the oldest leaf is 1->2; its parent 1 stays
    assert (trie.count([1, 2]), trie.count([1]), trie.count([2]), trie.count([7])) == (0, 1, 1, 1)
    assert trie.followers([2]) == []
    trie.insert([8], new_from=0)       # 1 became a leaf, and it is now the oldest
    assert (trie.count([1]), trie.count([2]), trie.count([8])) == (0, 1, 1)
    trie.check()


def test_followers_lookup_refreshes_lru():
    trie = SuffixTrie(branch_length=2, capacity=4)
    trie.insert([5, 6], new_from=0)    # 5, 5->6, 6
    trie.insert([9], new_from=0)       # 9 (newest)
    assert [(token, count) for token, count, _ in trie.followers([5])] == [(6, 1)]
    trie.insert([3], new_from=0)       # evicts 6: the lookup touched 5 and its child 5->6
    assert (trie.count([5, 6]), trie.count([6]), trie.count([9])) == (1, 0, 1)


def test_release_forgets_request_state_but_not_the_shared_trie():
    own, shared = NgramDrafter(), NgramDrafter(scope="global")
    for drafter in (own, shared):
        begin(drafter, [[1, 2, 1]])
        drafter.release([0])
    frontier = chain_frontier([[1, 2, 1]], [[]], k=1)
    with pytest.raises(KeyError, match="never begun"):
        own.expand(frontier)
    assert answers(shared.expand(frontier), 0, 0) == [(2, 0.0)]


def test_frontier_padding_and_truncation():
    drafter = NgramDrafter(min_window=1, max_window=1)
    context = [0, 1, 0, 2, 0, 1, 0, 3, 0]    # after 0: 1 twice, then 2 and 3 once (3 most recent)
    begin(drafter, [context])
    frontier = chain_frontier([context], [[]], k=2)
    frontier.nodes = torch.tensor([[0, -1]])
    expansion = drafter.expand(frontier)
    tokens, logprobs = zip(*answers(expansion, 0, 0))
    assert tokens == (1, 3) and logprobs == pytest.approx((math.log(2 / 4), math.log(1 / 4)))
    assert answers(expansion, 0, 1) == []


def test_registered_and_built_from_config():
    drafter = build_component(DRAFTERS, {"type": "ngram", "scope": "global", "capacity": 10}, vocab_size=V)
    assert isinstance(drafter, Drafter) and drafter.trie.capacity == 10 and drafter.vocab_size == V
    with pytest.raises(ConfigError, match="valid keys: min_window, max_window"):
        build_component(DRAFTERS, {"type": "ngram", "max_windw": 4})


@pytest.mark.parametrize("kwargs, message", [
    ({"min_window": 0}, "min_window must be >= 1"),
    ({"min_window": 3, "max_window": 2}, "max_window must be >= min_window"),
    ({"capacity": 0}, "capacity must be >= 1"),
    ({"scope": "galaxy"}, "scope must be one of request, global"),
    ({"scope": "global", "max_window": 4, "branch_length": 4}, "branch_length must be > max_window"),
])
def test_invalid_parameters_name_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_component(DRAFTERS, {"type": "ngram", **kwargs})


def test_want_probs_needs_vocab_size():
    drafter = NgramDrafter()
    begin(drafter, [[1, 2, 1]])
    with pytest.raises(ValueError, match="vocab_size"):
        drafter.expand(chain_frontier([[1, 2, 1]], [[]], k=1, want_probs=True))
