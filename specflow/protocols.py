"""The research API: the three component contracts and what flows into drafters from the target."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from torch import Tensor

from specflow.sampling import SamplingBatch
from specflow.tree import DraftTree, Expansion, Frontier, Roots, Verdict


@dataclass(frozen=True)
class TargetNeeds:
    """Which target features a drafter reads: the final normed hidden state and/or the hidden
    states entering chosen layers (EAGLE-3 taps), for every committed token."""

    last_hidden: bool = False
    layer_taps: tuple[int, ...] = ()


@dataclass
class TargetFeatures:
    """Committed tokens of some requests with their target features.

    After prefill (``Drafter.begin``) the tokens are the prompt; after a step
    (``Drafter.commit``) they are the accepted path, root first. ``next_tokens`` is the token
    that follows them (the first sampled token, or the bonus token), which becomes the next root.
    """

    request_ids: list[int]
    tokens: list[Tensor]            # per request [n] token ids
    positions: list[Tensor]         # per request [n]
    next_tokens: list[int]
    hidden: list[Tensor] | None = None  # per request [n, H] final normed hidden states
    taps: list[Tensor] | None = None    # per request [n, len(layer_taps) * H], taps concatenated in order
    contexts: list[list[int]] = field(default_factory=list)  # all committed ids incl. next token


@runtime_checkable
class Drafter(Protocol):
    """Proposes draft tokens (``expand``) and keeps per-request state (``begin`` / ``commit`` /
    ``release``). A drafter whose drafts for one request can hold another request's tokens (an
    n-gram trie shared by all) sets ``learns_across_requests = True``: the engine then keys the
    coin walks (``SamplingBatch.coin_walk``) and the sampled drafts (``Request.generator``) of its
    requests apart, which sampled verification needs to stay lossless between requests of the
    same seed."""

    needs: TargetNeeds

    def begin(self, features: TargetFeatures) -> None: ...
    def expand(self, frontier: Frontier) -> Expansion: ...
    def commit(self, verdict: Verdict, features: TargetFeatures) -> None: ...
    def release(self, request_ids: list[int]) -> None: ...


@runtime_checkable
class BeamDrafter(Drafter, Protocol):
    """A drafter that runs an EAGLE-2 beam itself (EAGLE heads, draft models; see
    specflow.runtime.beam): ``beam(roots, k, levels)`` expands the roots, keeping their children
    on its device (``children``, ``children_logprobs`` [B, 1, k]), and returns a ``Beam`` whose
    ``run(fn, state, key)`` runs the builder's levels ``fn``, which call its ``expand(choice
    [B, k])`` to feed each of the ``levels`` after the root; None, with nothing expanded, where
    it cannot for this batch."""

    def beam(self, roots: Roots, k: int, levels: int): ...


@runtime_checkable
class TreeBuilder(Protocol):
    num_draft_tokens: int

    def build(self, drafter: Drafter, roots: Roots) -> DraftTree: ...


@runtime_checkable
class Verifier(Protocol):
    lossless: bool

    def verify(self, tree: DraftTree, target_logits: Tensor, sampling: SamplingBatch) -> Verdict: ...
