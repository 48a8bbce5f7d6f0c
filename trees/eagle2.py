"""EAGLE-2 dynamic tree: a beam of the top-k nodes by cumulative draft probability, then a
global rerank of every candidate to N nodes (EAGLE ``topK_genrate``, SGLang
``select_top_k_tokens`` + ``organize_draft_results``)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch import Tensor

from specflow.protocols import Drafter
from specflow.registry import TREE_BUILDERS
from specflow.tree import DraftTree, Roots
from trees.growth import GrowingTree


TREE_FIELDS = ("tokens", "parents", "depth", "positions", "scores", "valid", "sampled", "mask")  # a beam's DraftTree


@dataclass
class Eagle2Config:
    topk: int = 8                # children per expanded node, and the beam width
    depth: int = 5               # levels of candidates (drafter calls)
    num_draft_tokens: int = 32   # N, root included


@TREE_BUILDERS.register("eagle2", config=Eagle2Config)
class Eagle2Builder:
    """Beam search over the drafter, then keep the N - 1 best candidates.

    Step 0 expands the root with k = topk. Each further step expands the whole frontier (topk
    nodes) at once, scores each of the topk^2 children as parent score x child probability,
    records them all as candidates and keeps the global top-k as the next frontier. After
    ``depth`` levels, the N - 1 best candidates (over 1 + topk + (depth - 1) topk^2, which caps N) are kept,
    sorted by candidate index so parents precede children. Candidates without a child (-inf) or
    with a NaN score are never kept; when fewer than N - 1 remain the tree is padded.

    A ``BeamDrafter`` (the EAGLE heads, the draft model) expands the levels after the root
    itself, with the trees level-by-level expansion would give: the builder's levels then run on
    the drafter's device as one CUDA graph when graphs are on (specflow.runtime.beam).
    """

    def __init__(self, topk: int = 8, depth: int = 5, num_draft_tokens: int = 32):
        checks = [
            (topk >= 1, f"topk must be >= 1, got {topk}"),
            (depth >= 1, f"depth must be >= 1, got {depth}"),
            (num_draft_tokens >= 2, f"num_draft_tokens must be >= 2 (root included: 1 is plain decoding), "
                                    f"got {num_draft_tokens}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"eagle2 tree: {message}")
        # a budget beyond the candidates would only verify padding (SGLang likewise sets N = depth + 1 at topk 1)
        self.topk, self.depth = topk, depth
        self.num_draft_tokens = min(num_draft_tokens, 1 + topk + (depth - 1) * topk * topk)

    @classmethod
    def from_config(cls, cfg: Eagle2Config, **_) -> "Eagle2Builder":
        return cls(topk=cfg.topk, depth=cfg.depth, num_draft_tokens=cfg.num_draft_tokens)

    def build(self, drafter: Drafter, roots: Roots) -> DraftTree:
        b, k = roots.batch_size, self.topk
        capacity = 1 + k + (self.depth - 1) * k * k  # every candidate a column
        # a BeamDrafter (the EAGLE heads, the draft model) runs the build itself: the roots, then
        # the levels on its device as one CUDA graph, with no value read back before the tree
        # (checked by attribute, as isinstance on a protocol costs a check per member)
        beam = drafter.beam(roots, k, self.depth - 1) if self.depth > 1 and hasattr(drafter, "beam") else None
        if beam is None:
            grow = GrowingTree(roots, capacity)
            root = torch.zeros(b, 1, dtype=torch.long, device=roots.tokens.device)
            tokens, logprobs, sampled = grow.expand(drafter, root, k)   # [B, 1, k] the root's children
            self._levels(grow, tokens, logprobs, sampled, lambda frontier, best: grow.expand(drafter, frontier, k))
            return rerank(grow, self.num_draft_tokens, self.depth)

        def build_rest(root_tokens: Tensor, root_positions: Tensor, children: Tensor,
                       children_logprobs: Tensor) -> tuple[Tensor, ...]:  # the tree's columns, the levels, the rerank
            # the roots over the graph's rows, padding requests' included (the tree reads nothing else of them)
            tree = GrowingTree(replace(roots, tokens=root_tokens, positions=root_positions), capacity)
            self._levels(tree, *picks(children, children_logprobs), lambda frontier, best: picks(*beam.expand(best)))
            kept = rerank(tree, self.num_draft_tokens, self.depth)
            return tuple(getattr(kept, name) for name in TREE_FIELDS)

        key = ("eagle2", k, self.depth, self.num_draft_tokens)
        state = (roots.tokens, roots.positions, beam.children, beam.children_logprobs)  # (the roots', moved by run)
        return DraftTree(**dict(zip(TREE_FIELDS, beam.run(build_rest, state, key))), max_depth=self.depth)

    def _levels(self, grow: GrowingTree, tokens: Tensor, logprobs: Tensor, sampled: Tensor,
                expand: Callable[[Tensor, Tensor], tuple[Tensor, Tensor, Tensor]]) -> None:
        """Grow ``depth`` levels into ``grow``, from the root's children [B, 1, k]: add a level's
        children, keep its top-k as the frontier [B, k], and ``expand(frontier, best)`` them
        (``best`` [B, k]: the kept children among the level's, -1 where none) for the next
        level's children [B, k, k]. Device ops only: no value comes to the host."""
        b, k, dev = grow.tokens.shape[0], self.topk, grow.tokens.device
        frontier = torch.zeros(b, 1, dtype=torch.long, device=dev)  # [B, F], F = 1 then k
        for level in range(self.depth):
            f = frontier.shape[1]
            first = grow.size
            grow.add(frontier.repeat_interleave(k, dim=1), tokens.flatten(1), logprobs.flatten(1),
                     sampled.flatten(1))
            cols = first + torch.arange(f * k, device=dev)                   # this level's children
            best = top_candidates(grow.logscores[:, cols], k)                # [B, k] into cols
            frontier = torch.where(best >= 0, cols[best.clamp(min=0)], -1)
            if level + 1 == self.depth:
                return
            tokens, logprobs, sampled = expand(frontier, best)


def picks(tokens: Tensor, logprobs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """A beam's children as GrowingTree.expand answers them: top-k picks, none sampled."""
    return tokens, logprobs, torch.zeros_like(tokens, dtype=torch.bool)


def top_candidates(logscores: Tensor, n: int) -> Tensor:
    """Indices [B, n] of the n best of [B, C] log-scores, -1 where fewer than n are real.

    -inf (no child) and NaN never count; ties go to the earlier candidate (stable sort), so a
    child that ties its parent never displaces it.
    """
    keys = logscores.masked_fill(logscores.isnan(), float("-inf"))
    keys, order = keys.sort(dim=-1, descending=True, stable=True)
    keys, order = keys[:, :n], order[:, :n]
    if order.shape[1] < n:  # fewer candidates than asked
        pad = n - order.shape[1]
        keys = torch.cat([keys, keys.new_full((keys.shape[0], pad), float("-inf"))], 1)
        order = torch.cat([order, order.new_zeros(order.shape[0], pad)], 1)
    return torch.where(keys > float("-inf"), order, -1)


def rerank(grow: GrowingTree, n: int, max_depth: int) -> DraftTree:
    """The root plus the n - 1 best candidates of ``grow`` (none deeper than ``max_depth``), in
    candidate order, parents re-indexed; device ops only.

    Scores never rise down a path and ties go to the earlier candidate, so every kept node's
    parent is kept and, being an earlier candidate, gets a smaller new index.
    """
    cand = grow.tree(grow.capacity)
    b, c = cand.tokens.shape
    best = top_candidates(grow.logscores[:, 1:c], n - 1)          # [B, n-1] into columns 1..c-1
    keep = best >= 0
    cols = torch.where(keep, best + 1, c).sort(dim=-1).values      # ascending; padding (c) last
    keep = cols < c
    root = cols.new_zeros(b, 1)
    cols_all = torch.cat([root, cols.clamp(max=c - 1)], 1)         # [B, n] with the root first
    keep_all = torch.cat([root >= 0, keep], 1)
    new_index = torch.zeros(b, c + 1, dtype=torch.long, device=cols.device)  # candidate -> node
    new_index.scatter_(1, torch.cat([root, cols], 1), torch.arange(n, device=cols.device).expand(b, n))
    parents = new_index.gather(1, cand.parents.gather(1, cols_all).clamp(min=0))
    parents[:, 0] = -1

    def take(x: Tensor, pad) -> Tensor:
        return torch.where(keep_all, x.gather(1, cols_all), pad)

    depth = take(cand.depth, 1)
    return DraftTree(
        tokens=take(cand.tokens, 0), parents=torch.where(keep_all, parents, 0), depth=depth,
        positions=cand.positions[:, :1] + depth, scores=take(cand.scores, 0.0),
        valid=keep_all, sampled=take(cand.sampled, False)).with_mask(max_depth)
