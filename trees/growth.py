"""GrowingTree: a draft tree while a builder grows it, and the one expand call every builder makes.

Builders differ in which nodes they expand and where the children go; what they share lives
here: asking the drafter (top-k, or draws without replacement from q for sampled drafting),
deciding which children exist, and the cumulative scores.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specflow.protocols import Drafter
from specflow.tree import DraftTree, Frontier, Roots


class GrowingTree:
    """B requests x ``capacity`` node columns of a tree under construction.

    Column 0 is the root; every other column is padding (token 0, parent 0, depth 1, invalid,
    score 0) until a child is written into it. One extra column past ``capacity`` is a sink for
    writes that must not land, so no write needs a host sync. ``size`` is one past the highest
    column handed out so far: the partial tree drafters see.

    With ``sample=True``, non-greedy requests draw their children from q without replacement
    (Sequoia) instead of taking the top-k, and q of every expanded node is kept in
    ``draft_probs`` for the verifier; that needs ``roots.generators``.
    """

    def __init__(self, roots: Roots, capacity: int, sample: bool = False):
        b, dev = len(roots.tokens), roots.tokens.device  # (a beam graph's roots: padding requests' rows too)
        cols = capacity + 1  # + the sink
        self.roots, self.capacity, self.size, self.sample = roots, capacity, 1, sample
        self.root_positions = roots.positions.to(dev, torch.long)  # [B]
        self.tokens = torch.zeros(b, cols, dtype=torch.long, device=dev)
        self.tokens[:, 0] = roots.tokens
        self.parents = torch.zeros(b, cols, dtype=torch.long, device=dev)
        self.parents[:, 0] = -1
        self.depth = torch.ones(b, cols, dtype=torch.long, device=dev)
        self.depth[:, 0] = 0
        # log of the cumulative draft probability; -inf on padding, so it never ranks
        self.logscores = torch.full((b, cols), float("-inf"), device=dev)
        self.logscores[:, 0] = 0.0
        self.valid = torch.zeros(b, cols, dtype=torch.bool, device=dev)
        self.valid[:, 0] = True
        self.sampled = torch.zeros(b, cols, dtype=torch.bool, device=dev)
        self.draft_probs: Tensor | None = None  # [B, cols, V] once a sampled expansion ran
        self._sample_rows: list[int] = []
        if sample:
            if roots.generators is None:
                raise ValueError("sampled drafting (sample=True) needs Roots.generators: "
                                 "one torch.Generator per request")
            greedy = roots.greedy.tolist() if roots.greedy is not None else [False] * b
            self._sample_rows = [r for r in range(b) if not greedy[r]]

    def tree(self, n: int | None = None) -> DraftTree:
        """The first ``n`` columns (default ``size``) as a DraftTree without mask."""
        n = self.size if n is None else n
        depth = self.depth[:, :n]
        return DraftTree(
            tokens=self.tokens[:, :n], parents=self.parents[:, :n], depth=depth,
            positions=self.root_positions.view(-1, 1) + depth,
            scores=self.logscores[:, :n].exp(), valid=self.valid[:, :n], sampled=self.sampled[:, :n],
            draft_probs=None if self.draft_probs is None else self.draft_probs[:, :n])

    def finish(self) -> DraftTree:
        """All ``capacity`` columns, mask filled: the builder's answer."""
        return self.tree(self.capacity).with_mask()

    def expand(self, drafter: Drafter, nodes: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
        """Children of the frontier ``nodes`` [B, F] (-1 = none): tokens, logprobs, sampled [B, F, k].

        Top-k of the drafter's answer (descending); sampled rows hold k draws without
        replacement in draw order (-inf logprob once q has no mass left).
        """
        b, f = nodes.shape
        out = drafter.expand(Frontier(self.roots, self.tree(), nodes, k, want_probs=self.sample, budget=self.capacity))
        name = type(drafter).__name__
        if out.tokens.shape != (b, f, k) or out.logprobs.shape != (b, f, k):
            raise ValueError(f"{name}.expand returned tokens {tuple(out.tokens.shape)} and logprobs "
                             f"{tuple(out.logprobs.shape)}; the frontier asks for [B, F, k] = {(b, f, k)}")
        if out.tokens.dtype.is_floating_point or out.tokens.dtype.is_complex or out.tokens.dtype == torch.bool:
            raise ValueError(f"{name}.expand returned tokens of dtype {out.tokens.dtype}; they are token ids: "
                             f"torch.long")
        tokens, logprobs = out.tokens.long(), out.logprobs.float()
        if self.roots.check_drafts:
            check_logprobs(name, logprobs, nodes)
        sampled = torch.zeros_like(tokens, dtype=torch.bool)
        if not self.sample:
            return tokens, logprobs, sampled
        if out.probs is None:
            raise ValueError(f"{name}.expand returned no probs although the frontier asked "
                             "for them (want_probs=True, sampled drafting)")
        if out.probs.dim() != 3 or out.probs.shape[:2] != (b, f):
            raise ValueError(f"{name}.expand returned probs {tuple(out.probs.shape)}; the frontier asks for "
                             f"[B, F, V] with [B, F] = {(b, f)}")
        # [B, F, V], rows normalised: a q that does not sum to 1 (top-k probs left unnormalised)
        # is drawn from as its normalised law (Gumbel-top-k ranks log q), which the verifier must see
        q = out.probs.float()
        q = q / q.sum(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
        self._record_probs(nodes, q)
        if self._sample_rows:
            rows = torch.tensor(self._sample_rows, device=nodes.device)
            gens = [self.roots.generators[r] for r in self._sample_rows]
            drawn, drawn_logprobs = draw_without_replacement(q[rows], k, gens)  # [R, F, k]
            tokens, logprobs, sampled = tokens.clone(), logprobs.clone(), sampled.clone()
            tokens[rows], logprobs[rows], sampled[rows] = drawn, drawn_logprobs, True
        return tokens, logprobs, sampled

    def exists(self, parents: Tensor, logprobs: Tensor) -> Tensor:
        """[B, M] bool: the child has a valid parent and a real log-prob (not -inf, not NaN)."""
        parent_valid = self.valid.gather(1, parents.clamp(min=0)) & (parents >= 0)
        return parent_valid & (logprobs > float("-inf"))  # NaN compares False

    def add(self, parents: Tensor, tokens: Tensor, logprobs: Tensor, sampled: Tensor,
            cols: Tensor | None = None) -> None:
        """Write children [B, M] under ``parents`` at columns ``cols`` (default: the next M).

        Children that do not exist (see ``exists``) and columns at or past ``capacity`` stay
        padding. Log-probs are clamped to <= 0 so a score never rises down a path: EAGLE-2's
        rerank relies on it to keep every chosen node's ancestors.
        """
        b, m = parents.shape
        if cols is None:
            cols = (self.size + torch.arange(m, device=parents.device)).expand(b, m)
            self.size = min(self.size + m, self.capacity)
        else:
            inside = cols.masked_fill(cols >= self.capacity, -1)
            self.size = max(self.size, int(inside.max()) + 1)
        logprobs = logprobs.clamp(max=0.0)
        ok = self.exists(parents, logprobs) & (cols < self.capacity)
        cols = torch.where(ok, cols, self.capacity)  # rejected writes go to the sink column
        par = parents.clamp(min=0)
        self.tokens.scatter_(1, cols, tokens)
        self.parents.scatter_(1, cols, par)
        self.depth.scatter_(1, cols, self.depth.gather(1, par) + 1)
        self.logscores.scatter_(1, cols, self.logscores.gather(1, par) + logprobs)
        self.valid.scatter_(1, cols, ok)
        self.sampled.scatter_(1, cols, sampled & ok)

    def _record_probs(self, nodes: Tensor, q: Tensor) -> None:
        """draft_probs[b, nodes[b, f]] = q[b, f] for real frontier nodes ([B, F], [B, F, V])."""
        b, f, v = q.shape
        if self.draft_probs is None:
            self.draft_probs = q.new_zeros(b, self.capacity + 1, v)
        cols = torch.where(nodes >= 0, nodes, self.capacity)  # -1 -> the sink
        self.draft_probs.scatter_(1, cols.unsqueeze(-1).expand(b, f, v), q)


def check_logprobs(name: str, logprobs: Tensor, nodes: Tensor) -> None:
    """Refuse, naming the drafter, an expansion's log-probs [B, F, k] under real frontier nodes
    [B, F] that are NaN, above 0 (past float rounding) or not descending: the builders would read
    a NaN as "no child" and clamp the others, so a broken drafter would look like a weak one."""
    real = (nodes >= 0)[..., None].expand_as(logprobs)                                 # [B, F, k]
    if bool((logprobs.isnan() & real).any()):
        raise ValueError(f"{name}.expand returned NaN log-probs (-inf says \"no child\")")
    if bool(((logprobs > 1e-5) & real).any()):
        raise ValueError(f"{name}.expand returned log-probs above 0 (max {float(logprobs[real].max()):.4g}): "
                         f"log q(child | path) is <= 0")
    if bool(((logprobs[..., 1:] > logprobs[..., :-1]) & real[..., 1:]).any()):
        raise ValueError(f"{name}.expand returned log-probs that do not descend along k: children come "
                         f"most likely first")


def draw_without_replacement(q: Tensor, k: int, generators: list[torch.Generator]) -> tuple[Tensor, Tensor]:
    """k ordered draws without replacement from each row of q [R, F, V] -> tokens, logprobs [R, F, k].

    Gumbel-top-k: ranking log q + Gumbel noise yields the same ordered sample as drawing one
    token at a time and removing it (Kool et al., 2019). Draws past q's support get -inf.
    Request r's noise comes from ``generators[r]``.
    """
    r, f, v = q.shape
    noise = torch.stack([torch.empty(f, v).exponential_(generator=g) for g in generators])
    keys = q.log() - noise.to(q.device).log()  # -log(Exp(1)) is Gumbel(0, 1); q = 0 -> -inf
    kk = min(k, v)
    keys, tokens = keys.topk(kk, dim=-1)  # [R, F, kk] in draw order
    logprobs = q.gather(-1, tokens).log().masked_fill(keys == float("-inf"), float("-inf"))
    if kk < k:  # more children asked than the vocabulary holds
        tokens = torch.cat([tokens, tokens.new_zeros(r, f, k - kk)], -1)
        logprobs = torch.cat([logprobs, logprobs.new_full((r, f, k - kk), float("-inf"))], -1)
    return tokens, logprobs
