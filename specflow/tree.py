"""The data that flows between drafters, tree builders, verifiers and the engine.

Conventions (every component relies on them):
- A tree has N nodes per request; node 0 is the root: the last committed token, whose K/V the
  target has not computed yet. Its position is ``root_position = seq_len - 1``.
- ``parents[b, i] < i`` for every non-root node (parents precede children); children of a node
  are ordered by node index.
- ``mask[b, i, j]`` is True when node j is node i itself or one of its ancestors.
- Padding nodes (``valid == False``) hang under the root, are never accepted, and their
  ``tokens`` are 0; a builder that finds fewer than N candidates pads with them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from specflow.runtime.transfer import to_device, to_host


@dataclass(slots=True)
class Roots:
    """Where each request's next tree starts."""

    request_ids: list[int]
    tokens: Tensor        # [B] root token ids (last committed token)
    positions: Tensor     # [B] root positions (seq_len - 1)
    contexts: list[list[int]]  # committed token ids per request, root included (for n-gram lookup)
    generators: list[torch.Generator] | None = None  # per request, for builders that sample drafts
    greedy: Tensor | None = None  # [B] bool: temperature-0 requests (sampling builders take top-k)
    check_drafts: bool = False  # the engine's: GrowingTree.expand checks each answer's log-probs (a wait each)

    @property
    def batch_size(self) -> int:
        return len(self.request_ids)

    def select(self, rows: list[int]) -> "Roots":
        """The roots of some requests of the batch (e.g. those that speculate this step)."""
        return Roots([self.request_ids[r] for r in rows], self.tokens[rows], self.positions[rows],
                     [self.contexts[r] for r in rows],
                     None if self.generators is None else [self.generators[r] for r in rows],
                     None if self.greedy is None else self.greedy[rows], self.check_drafts)


@dataclass(slots=True)
class Frontier:
    """Nodes of partially built trees that a builder asks a drafter to expand.

    ``tree`` holds the first n nodes built so far (its ``mask`` and ``draft_probs`` may be None);
    ``nodes[b, f]`` indexes into it, -1 where request b has fewer than F nodes to expand. Within
    one build a node keeps its index (builders append nodes and may renumber only after their
    last expansion, as EAGLE-2's rerank does): model drafters find a node's parent by index.
    Model drafters reserve their KV pages for ``budget`` nodes when a tree starts, so a pool that
    is too small fails before any draw (a failure that depended on the draws would bias them).
    """

    roots: Roots
    tree: "DraftTree"
    nodes: Tensor         # [B, F] int64
    k: int                # children wanted per node
    want_probs: bool      # also return the full child distribution q
    budget: int | None = None  # the most nodes the trees may reach (N, root included), when known


@dataclass(slots=True)
class Expansion:
    """A drafter's answer for a Frontier."""

    tokens: Tensor        # [B, F, k] child token ids (any value where logprobs is -inf)
    logprobs: Tensor      # [B, F, k] log q(child | path), descending; -inf marks "no child"
    probs: Tensor | None = None  # [B, F, V] full child distribution q, when asked


@dataclass
class DraftTree:
    """A batch of draft trees with the same node budget N (see module docstring)."""

    tokens: Tensor        # [B, N] int64
    parents: Tensor       # [B, N] int64, -1 at the root
    depth: Tensor         # [B, N] int64, 0 at the root
    positions: Tensor     # [B, N] int64, root_position + depth
    scores: Tensor        # [B, N] float32, cumulative draft probability along the path (root 1)
    valid: Tensor         # [B, N] bool
    sampled: Tensor       # [B, N] bool: token drawn from q of its parent (else a top-k pick)
    mask: Tensor | None = None         # [B, N, N] bool ancestor-or-self
    draft_probs: Tensor | None = None  # [B, N, V] q over the children of each node (sampled drafts)
    max_depth: int | None = None       # a bound on every node's depth known on the host (None: read ``depth``)
    max_tries: int | None = None       # a bound, known on the host, on the children a walk from the root
                                       # tries: accepted ones and rejected siblings (None: N - 1)

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    @staticmethod
    def root_only(roots: Roots) -> "DraftTree":
        """The one-node tree of plain autoregressive decoding."""
        b = roots.batch_size
        long = dict(dtype=torch.long, device=roots.tokens.device)
        return DraftTree(
            tokens=roots.tokens.view(b, 1).long(),
            parents=torch.full((b, 1), -1, **long),
            depth=torch.zeros((b, 1), **long),
            positions=roots.positions.view(b, 1).long(),
            scores=torch.ones((b, 1), device=roots.tokens.device),
            valid=torch.ones((b, 1), dtype=torch.bool, device=roots.tokens.device),
            sampled=torch.zeros((b, 1), dtype=torch.bool, device=roots.tokens.device),
            mask=torch.ones((b, 1, 1), dtype=torch.bool, device=roots.tokens.device),
            max_depth=0,
            max_tries=0,
        )

    def to(self, device: torch.device) -> "DraftTree":
        """This tree on ``device``, its host tensors moved in one copy (specflow.runtime.transfer),
        ``draft_probs`` too (a host drafter's q, [B, N, V]); a host tree's ``max_depth`` is filled
        in on the way."""
        names = [f.name for f in dataclasses.fields(self) if isinstance(getattr(self, f.name), Tensor)]
        moved = to_device([getattr(self, name) for name in names], device)
        host = self.depth.device.type == "cpu"
        return dataclasses.replace(self, **dict(zip(names, moved)),
                                   max_depth=self.depth_bound() if host else self.max_depth)

    def depth_bound(self) -> int:
        """``max_depth``, else the deepest node's depth (read back from the device if it lies there)."""
        if self.max_depth is not None:
            return self.max_depth
        return int(self.depth.max()) if self.depth.numel() else 0

    def pad_to(self, n: int) -> "DraftTree":
        """Append padding nodes (invalid, token 0, under the root) up to n nodes."""
        b, extra = self.batch_size, n - self.num_nodes
        assert extra >= 0
        if extra == 0:
            return self
        dev = self.tokens.device

        def grow(x: Tensor, value) -> Tensor:
            return torch.cat([x, torch.full((b, extra), value, dtype=x.dtype, device=dev)], 1)

        probs = self.draft_probs
        if probs is not None:
            probs = torch.cat([probs, probs.new_zeros(b, extra, probs.shape[-1])], 1)
        depth = grow(self.depth, 1)
        bound = None if self.max_depth is None else max(self.max_depth, 1)
        return DraftTree(grow(self.tokens, 0), grow(self.parents, 0), depth, self.positions[:, :1] + depth,
                         grow(self.scores, 0.0), grow(self.valid, False), grow(self.sampled, False),
                         None, probs, max_tries=self.max_tries).with_mask(bound)  # (padding is no child)

    def place(self, rows: list[int], sub: "DraftTree") -> "DraftTree":
        """A copy of this tree with rows ``rows`` replaced by the rows of ``sub`` (same N), on
        ``sub``'s device (this tree moved there in one copy)."""
        assert sub.num_nodes == self.num_nodes
        device = sub.tokens.device
        base = self.to(device)
        index, = to_device([torch.tensor(rows)], device)
        out = dataclasses.replace(base)
        for name in ("tokens", "parents", "depth", "positions", "scores", "valid", "sampled", "mask"):
            full = getattr(base, name)
            setattr(out, name, full.index_copy(0, index, getattr(sub, name).to(full.dtype)))
        if sub.draft_probs is not None:
            out.draft_probs = sub.draft_probs.new_zeros(self.batch_size, *sub.draft_probs.shape[1:]).index_copy(
                0, index.to(sub.draft_probs.device), sub.draft_probs)
        for bound in ("max_depth", "max_tries"):
            values = (getattr(base, bound), getattr(sub, bound))
            setattr(out, bound, None if None in values else max(values))
        return out

    def with_mask(self, depth: int | None = None) -> "DraftTree":
        """Fill ``mask`` from ``parents`` (ancestor-or-self, see ``ancestor_mask``); ``depth``, a
        bound on every node's depth, becomes ``max_depth``."""
        self.mask = ancestor_mask(self.parents, depth)
        if depth is not None:
            self.max_depth = depth
        return self

    def path_to(self, b: int, node: int) -> list[int]:
        """Node indices from the root down to ``node`` in request b."""
        path = []
        parents = self.parents[b].tolist()
        while node >= 0:
            path.append(node)
            node = parents[node]
        return path[::-1]

    def check(self) -> None:
        """Raise ValueError naming the first broken structural invariant: the root at node 0 and
        valid, every other node's parent before it, depth = parent depth + 1 (within
        ``max_depth``), positions = root position + depth, a valid node's parent valid,
        ``draft_probs`` where nodes are sampled, and ``mask`` the ancestor-or-self mask of
        ``parents``. One read back to the host when the tree is sound (a CPU run checks every tree)."""
        b, n = self.tokens.shape
        for name in ("parents", "depth", "positions", "scores", "valid", "sampled"):
            if (shape := tuple(getattr(self, name).shape)) != (b, n):
                raise ValueError(f"{name} has shape {shape}; tokens' is [B, N] = {[b, n]}")
        if self.mask is not None and self.mask.shape != (b, n, n):
            raise ValueError(f"mask has shape {tuple(self.mask.shape)}, not [B, N, N] = {[b, n, n]}")
        eye = torch.eye(n, dtype=torch.bool, device=self.parents.device)                   # [N, N]
        parents = self.parents[:, 1:]                                                      # [B, N - 1]
        at = parents.clamp(0, max(n - 1, 0))
        checks = [("node 0 must be the root", self.parents[:, :1] == -1),
                  ("the root must be valid", self.valid[:, :1]),
                  ("every node but the root has a parent, before it",
                   (parents >= 0) & (parents < torch.arange(1, n, device=parents.device))),
                  ("depth = parent depth + 1", self.depth[:, 1:] == self.depth.gather(1, at) + 1),
                  ("a valid node's parent must be valid", self.valid.gather(1, at) | ~self.valid[:, 1:]),
                  ("positions = root position + depth", self.positions == self.positions[:, :1] + self.depth)]
        if self.max_depth is not None:
            checks.append(("max_depth bounds every node's depth", self.depth <= self.max_depth))
        if self.draft_probs is None:
            checks.append(("sampled nodes need draft_probs (q at their parent, which the rejection rule reads)",
                           ~(self.sampled & self.valid)))
        if self.mask is not None:  # row 0 the root alone, row i column i | its parent's row: by induction
            parent_rows = self.mask.gather(1, at[..., None].expand(-1, -1, n))             # [B, N - 1, N]
            checks.append(("mask must be the ancestor-or-self mask of parents (ancestor_mask)",
                           self.mask == torch.cat([eye[:1].expand(b, 1, n), parent_rows | eye[1:]], 1)))
        if bool(torch.cat([ok.flatten(1) for _, ok in checks], 1).all()):
            return
        raise ValueError(next(message for message, ok in checks if not bool(ok.all())))

    def walk_tries(self) -> Tensor:
        """[B, N] the children a walk from the root tries to reach each valid node (at each depth
        its rank among its valid siblings, plus one) and then to test all of that node's valid
        children; 0 at padding. ``max_tries`` must bound it (read off ``mask``)."""
        idx = torch.arange(self.num_nodes, device=self.parents.device)                  # [N]
        child = self.valid & (idx > 0)                                                  # [B, N]
        sibling = child[:, None, :] & (self.parents[:, None, :] == self.parents[:, :, None])   # [B, N, N]
        cost = torch.where(child, (sibling & (idx < idx[:, None])).sum(-1) + 1, 0)      # [B, N] rank + 1
        reach = torch.where(self.mask & child[:, None, :], cost[:, None, :], 0).sum(-1)  # [B, N] along the path
        kids = (child[:, None, :] & (self.parents[:, None, :] == idx[:, None])).sum(-1)  # [B, N]
        return torch.where(self.valid, reach + kids, 0)

    def to_json(self) -> list[dict]:
        """Every request's tree as plain lists (for StepRecord), brought to the host in one copy."""
        tokens, parents, depth, scores, valid = (t.tolist() for t in to_host(
            [self.tokens, self.parents, self.depth, self.scores.float(), self.valid]))
        return [{"tokens": tokens[b], "parents": parents[b], "depth": depth[b],
                 # 6 significant digits, not decimals: deep paths' scores are tiny, and q is a ratio of two
                 "scores": [float(f"{s:.6g}") for s in scores[b]], "valid": valid[b]} for b in range(self.batch_size)]


def ancestor_mask(parents: Tensor, depth: int | None = None) -> Tensor:
    """[B, N] parent indices -> [B, N, N] bool, True where column j is row i or its ancestor.

    One vectorised step per tree level; given ``depth`` (a bound on every node's depth), exactly
    that many, with no value read back to the host (so CUDA graphs can record it)."""
    b, n = parents.shape
    mask = torch.eye(n, dtype=torch.bool, device=parents.device).repeat(b, 1, 1)
    anc = parents  # [B, N] current ancestor of each node (-1 when past the root)
    for _ in range(n if depth is None else depth):
        has = anc >= 0
        if depth is None and not bool(has.any()):
            break
        col = anc.clamp(min=0)[..., None]                                  # [B, N, 1]
        mask.scatter_(2, col, mask.gather(2, col) | has[..., None])
        anc = torch.where(has, parents.gather(1, col[..., 0]), anc)
    return mask


@dataclass
class Verdict:
    """What the verifier accepted, per request."""

    accepted: Tensor      # [B, D + 1] node indices on the accepted path, root first, -1 padded
    accept_len: Tensor    # [B] accepted draft tokens (root excluded); tokens committed = accept_len + 1
    bonus_tokens: Tensor  # [B] token sampled from the target at the last accepted node

    def accepted_nodes(self, b: int) -> list[int]:
        n = int(self.accept_len[b]) + 1
        return self.accepted[b, :n].tolist()


@dataclass
class StepRecord:
    """One speculative step of one request: tree + verdict + timings; JSON-serialisable.

    ``timings`` are the whole engine step's, which verified ``batch_size`` requests together:
    every request of the step carries the same numbers (per request: divide, or count each
    step once)."""

    request_id: int
    step: int
    tree: dict            # DraftTree.to_json
    accepted: list[int]   # node indices, root first
    bonus_token: int
    # tokens the request kept of this step's accepted drafts + bonus: fewer where max_tokens, an
    # EOS or a stop ended it inside them (its last step)
    kept: int
    timings: dict[str, float]  # seconds per stage of the step: draft, verify (target forward + verifier)
    batch_size: int = 1        # requests in the step the timings cover

    @property
    def accept_length(self) -> int:
        """Tokens this step committed (its entry of ``RequestOutput.accept_lengths``)."""
        return self.kept

    def to_json(self) -> dict:
        return dataclasses.asdict(self)
