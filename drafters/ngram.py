"""N-gram drafting: children of a tree node are the tokens that followed its context's suffix.

Two scopes share one answer format, ``Follower = (token, count, recency)``:

- ``request`` — prompt lookup (PLD) inside each request's own committed tokens, kept as an
  incremental n-gram -> follower table (``NgramIndex``), so a lookup never rescans the context.
- ``global`` — one token trie shared by every request (SGLang's NGRAM cache, ``SuffixTrie``):
  what one request generated drafts for the others; bounded in nodes with LRU eviction of leaves.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from specflow.protocols import TargetFeatures, TargetNeeds
from drafters.lookup import draft_paths, ranked_expansion
from specflow.registry import DRAFTERS
from specflow.tree import Expansion, Frontier, Verdict

SCOPES = ("request", "global")

Follower = tuple[int, int, int]  # (token, count, recency): larger recency = seen more recently


@dataclass
class NgramConfig:
    min_window: int = 1          # shortest suffix tried
    max_window: int = 3          # longest suffix tried first (PLD uses 3, HF prompt lookup 2)
    branch_length: int = 18      # global: longest string kept in the trie (SGLang default 18)
    capacity: int = 1_000_000    # global: trie size in nodes before LRU eviction
    scope: str = "request"       # "request" (own context) | "global" (trie shared by requests)

    def __post_init__(self):     # (a config's own checks run when it is validated: before the target loads)
        check_values(self.min_window, self.max_window, self.branch_length, self.capacity, self.scope)


def check_values(min_window: int, max_window: int, branch_length: int, capacity: int, scope: str) -> None:
    """Raise ValueError naming the first parameter the ngram drafter refuses."""
    checks = [
        (min_window >= 1, f"min_window must be >= 1, got {min_window}"),
        (max_window >= min_window, f"max_window must be >= min_window ({min_window}), got {max_window}"),
        (capacity >= 1, f"capacity must be >= 1 (trie nodes), got {capacity}"),
        (scope in SCOPES, f"scope must be one of {', '.join(SCOPES)}; got {scope!r}"),
        (scope != "global" or branch_length > max_window,
         f"branch_length must be > max_window ({max_window}) so a matched window has "
         f"children in the trie, got {branch_length}"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(f"ngram drafter: {message}")


class NgramIndex:
    """One request's committed tokens with an n-gram -> {follower: [count, last position]} table.

    The table holds every n-gram (min_window <= n <= max_window) that some committed token
    follows; ``extend`` adds only the positions committed since the last call.
    """

    def __init__(self, min_window: int, max_window: int):
        self.min_window, self.max_window = min_window, max_window
        self.tokens: list[int] = []
        self.table: dict[tuple[int, ...], dict[int, list[int]]] = {}

    def extend(self, committed: list[int]) -> None:
        """Index the tokens of ``committed`` (all committed ids) past those already indexed."""
        start = len(self.tokens)
        assert len(committed) >= start, "committed ids must extend the indexed ones"
        self.tokens.extend(committed[start:])
        for p in range(max(start, 1), len(self.tokens)):  # p: position of the follower
            for n in range(self.min_window, min(self.max_window, p) + 1):
                entry = self.table.setdefault(tuple(self.tokens[p - n:p]), {})
                count_last = entry.setdefault(self.tokens[p], [0, 0])
                count_last[0] += 1
                count_last[1] = p

    def followers(self, path: list[int]) -> list[Follower]:
        """Followers of the longest matching suffix of ``tokens + path`` (recency = position).

        Occurrences inside the committed tokens come from the table; the few whose follower lies
        in the speculative ``path`` are found by scanning the path.
        """
        ctx_tail = self.tokens[-self.max_window:]
        tail = ctx_tail + path  # tail[t] is position t + offset of the full sequence
        offset = len(self.tokens) - len(ctx_tail)
        length = len(self.tokens) + len(path)
        for n in range(min(self.max_window, length - 1), self.min_window - 1, -1):
            key = tuple(tail[-n:])
            found = {tok: tuple(cl) for tok, cl in self.table.get(key, {}).items()}
            for p in range(max(len(self.tokens), n), length):
                t = p - offset
                if tuple(tail[t - n:t]) == key:
                    count, _ = found.get(tail[t], (0, 0))
                    found[tail[t]] = (count + 1, p)
            if found:
                return [(tok, count, last) for tok, (count, last) in found.items()]
        return []


class _TrieNode:
    __slots__ = ("token", "parent", "children", "count", "stamp")

    def __init__(self, token: int, parent: "_TrieNode | None"):
        self.token, self.parent = token, parent
        self.children: dict[int, _TrieNode] = {}
        self.count = 0   # occurrences of the string root -> this node
        self.stamp = 0   # clock value of the last touch


class SuffixTrie:
    """Every substring of at most ``branch_length`` tokens of the inserted sequences, with counts.

    At most ``capacity`` nodes (root excluded); when full, the least recently touched leaf goes.
    Invariant of ``_lru`` (oldest first): a node precedes its parent, so the oldest is a leaf.
    Touching moves nodes to the end children first, which keeps the invariant.
    """

    def __init__(self, branch_length: int, capacity: int):
        self.branch_length, self.capacity = branch_length, capacity
        self.root = _TrieNode(-1, None)
        self._lru: OrderedDict[_TrieNode, None] = OrderedDict()
        self._clock = 0

    def __len__(self) -> int:
        return len(self._lru)

    def insert(self, tokens: list[int], new_from: int) -> None:
        """Count each string of ``tokens`` (at most branch_length long) ending at index >= new_from."""
        # a string longer than capacity cannot be held; a shorter one leaves, whenever the trie
        # is full, some node off the walked path to evict
        span = min(self.branch_length, self.capacity)
        for start in range(max(0, new_from - span + 1), len(tokens)):
            node, path = self.root, []
            for i, token in enumerate(tokens[start:start + span], start):
                child = node.children.get(token)
                if child is None:  # new, or evicted before: either way it occurred at least once
                    if len(self._lru) == self.capacity:
                        self._evict(path)
                    child = node.children[token] = _TrieNode(token, node)
                    self._lru[child] = None
                    child.count += 1
                elif i >= new_from:
                    child.count += 1
                path.append(child)
                node = child
            self._touch(path[::-1])

    def followers(self, string: list[int]) -> list[Follower]:
        """Children of the node spelling ``string`` (recency = last touch); touches them and the path."""
        node, path = self.root, []
        for token in string:
            node = node.children.get(token)
            if node is None:
                return []
            path.append(node)
        children = sorted(node.children.values(), key=lambda c: c.stamp)
        found = [(c.token, c.count, c.stamp) for c in children]
        if children:  # the proposed continuations are in use: keep them (siblings keep their order)
            self._touch(children + path[::-1])
        return found

    def count(self, string: list[int]) -> int:
        """Occurrences of ``string`` counted so far (0 if never seen or evicted); touches nothing."""
        node = self.root
        for token in string:
            node = node.children.get(token)
            if node is None:
                return 0
        return node.count

    def check(self) -> None:
        """Assert the structural invariants (used by tests)."""
        assert len(self._lru) <= self.capacity
        seen: set[_TrieNode] = set()
        for node in self._lru:  # oldest first: children come before their parent
            assert node.parent is not None and node.parent.children[node.token] is node
            assert node.parent is self.root or node.parent not in seen, "LRU order broken"
            assert all(c in seen for c in node.children.values()), "LRU order broken"
            assert node.count >= 1
            seen.add(node)

    def _touch(self, nodes: list[_TrieNode]) -> None:
        """Mark ``nodes`` most recently used, in this order (children before their parents)."""
        for node in nodes:
            self._clock += 1
            node.stamp = self._clock
            self._lru.move_to_end(node)

    def _evict(self, walking: list[_TrieNode]) -> None:
        """Drop the least recently touched leaf that is not on the path being walked."""
        # the walked nodes are not re-ordered until the walk ends; one of them can be the oldest
        while (oldest := next(iter(self._lru))) in walking:
            self._lru.move_to_end(oldest)
        del self._lru[oldest]
        assert not oldest.children, "the least recently touched node must be a leaf"
        del oldest.parent.children[oldest.token]


@DRAFTERS.register("ngram", config=NgramConfig)
class NgramDrafter:
    """Model-free drafter: proposes the tokens that followed the current suffix before.

    For a tree node, the context is the request's committed tokens plus the draft path down to
    the node. Suffix windows of ``max_window`` down to ``min_window`` tokens are tried, longest
    first; the first window with any follower answers. Children are ranked by how often they
    followed that window (ties: most recent first), with ``logprob = log(count / total)`` and,
    when asked, ``probs`` = that normalised count distribution over the vocabulary (rows of
    nodes without children are all zero).

    - ``scope="request"``: prompt lookup in the request's own context, including occurrences
      that end inside the draft path.
    - ``scope="global"``: lookup in one ``SuffixTrie`` shared by all requests, fed with each
      prompt at ``begin`` and each request's new tokens at ``commit`` (every suffix start, up to
      ``branch_length`` tokens); it holds at most ``capacity`` nodes, evicting least recently
      touched leaves. The draft path only extends the query suffix.
    """

    needs = TargetNeeds()

    def __init__(self, min_window: int = 1, max_window: int = 3, branch_length: int = 18,
                 capacity: int = 1_000_000, scope: str = "request", vocab_size: int | None = None):
        check_values(min_window, max_window, branch_length, capacity, scope)
        self.min_window, self.max_window, self.scope = min_window, max_window, scope
        self.learns_across_requests = scope == "global"   # (see protocols.Drafter)
        self.vocab_size = vocab_size
        self.trie = SuffixTrie(branch_length, capacity) if scope == "global" else None
        self._indexes: dict[int, NgramIndex] = {}  # request scope: per-request tables
        self._inserted: dict[int, int] = {}        # global scope: committed ids already in the trie

    @classmethod
    def from_config(cls, cfg: NgramConfig, vocab_size: int | None = None, **_) -> "NgramDrafter":
        return cls(min_window=cfg.min_window, max_window=cfg.max_window,
                   branch_length=cfg.branch_length, capacity=cfg.capacity, scope=cfg.scope,
                   vocab_size=vocab_size)

    def begin(self, features: TargetFeatures) -> None:
        for rid in features.request_ids:
            if self.trie is None:
                self._indexes[rid] = NgramIndex(self.min_window, self.max_window)
            else:
                self._inserted[rid] = 0
        self._add(features)

    def commit(self, verdict: Verdict, features: TargetFeatures) -> None:
        self._add(features)

    def release(self, request_ids: list[int]) -> None:
        for rid in request_ids:
            self._indexes.pop(rid, None)
            self._inserted.pop(rid, None)

    def expand(self, frontier: Frontier) -> Expansion:
        if frontier.want_probs and self.vocab_size is None:
            raise ValueError("ngram drafter: want_probs needs the vocabulary size; build it with "
                             "NgramDrafter(..., vocab_size=V) or from_config(cfg, vocab_size=V)")
        roots = frontier.roots
        answers = [[[] if path is None else self._ranked(roots.request_ids[b], roots.contexts[b], path)
                    for path in paths] for b, paths in enumerate(draft_paths(frontier))]
        return ranked_expansion(answers, frontier, self.vocab_size)

    def _ranked(self, rid: int, context: list[int], path: list[int]) -> list[tuple[int, int]]:
        """(token, count) of the followers, most counted first, then most recent."""
        return [(t, c) for t, c, _ in sorted(self._followers(rid, context, path), key=lambda x: (-x[1], -x[2]))]

    def _followers(self, rid: int, context: list[int], path: list[int]) -> list[Follower]:
        if self.trie is None:
            index = self._indexes.get(rid)
            if index is None:
                raise KeyError(f"ngram drafter: request {rid} was never begun (call begin first)")
            assert len(index.tokens) == len(context), f"request {rid}: index out of sync with context"
            return index.followers(path)
        query = (context[-self.max_window:] + path)[-self.max_window:]
        for n in range(len(query), self.min_window - 1, -1):
            found = self.trie.followers(query[-n:])
            if found:
                return found
        return []

    def _add(self, features: TargetFeatures) -> None:
        for rid, committed in zip(features.request_ids, _committed(features)):
            if self.trie is None:
                self._indexes[rid].extend(committed)
            else:
                self.trie.insert(committed, new_from=self._inserted[rid])
                self._inserted[rid] = len(committed)


def _committed(features: TargetFeatures) -> list[list[int]]:
    assert len(features.contexts) == len(features.request_ids), \
        "TargetFeatures.contexts must carry every request's committed ids"
    return features.contexts
