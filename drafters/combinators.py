"""Drafters made of other drafters: ``union`` merges their children, ``fallback`` takes the first
that has any. Each child sees every begin / expand / commit / release, so drafters with their own
caches (a draft model's KV) stay in step however the answers are combined.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from einops import rearrange

from specflow.config import build_component
from specflow.protocols import Drafter, TargetFeatures, TargetNeeds
from specflow.registry import DRAFTERS
from specflow.tree import Expansion, Frontier, Verdict


def _needs_children(kind: str, drafters: list[Any]) -> None:
    if not drafters:
        raise ValueError(f"{kind} drafter needs at least one drafter in `drafters`, "
                         f"e.g. drafters: [{{type: ngram}}, {{type: ngram, scope: global}}]")


@dataclass
class UnionConfig:
    drafters: list[Any] = field(default_factory=list)  # drafter nodes, e.g. [{type: ngram}, {type: eagle, path: ...}]

    def __post_init__(self):   # (runs when the config is validated: before the target loads)
        _needs_children("union", self.drafters)


@dataclass
class FallbackConfig:
    drafters: list[Any] = field(default_factory=list)  # drafter nodes, tried in order

    def __post_init__(self):
        _needs_children("fallback", self.drafters)


class DrafterGroup:
    """What every combinator shares: its children, their joint needs, and the lifecycle calls
    fanned out to all (a combinator only adds ``expand``).

    ``needs`` asks the target for the union of the children's features; each child then gets
    only the layer taps it declared, in its own order.
    """

    def __init__(self, drafters: list[Drafter]):
        _needs_children(getattr(type(self), "type_name", "combinator"), drafters)
        self.drafters = drafters
        self.learns_across_requests = any(getattr(d, "learns_across_requests", False) for d in drafters)
        taps = dict.fromkeys(t for d in drafters for t in d.needs.layer_taps)  # ordered set
        self.needs = TargetNeeds(last_hidden=any(d.needs.last_hidden for d in drafters),
                                 layer_taps=tuple(taps))

    @classmethod
    def from_config(cls, cfg: UnionConfig | FallbackConfig, **ctx: Any) -> "DrafterGroup":
        return cls([build_component(DRAFTERS, node, where=f"drafter.drafters[{i}]", **ctx)
                    for i, node in enumerate(cfg.drafters)])

    def begin(self, features: TargetFeatures) -> None:
        for d in self.drafters:
            d.begin(self._features_for(d, features))

    def commit(self, verdict: Verdict, features: TargetFeatures) -> None:
        for d in self.drafters:
            d.commit(verdict, self._features_for(d, features))

    def release(self, request_ids: list[int]) -> None:
        for d in self.drafters:
            d.release(request_ids)

    def expand_all(self, frontier: Frontier) -> list[Expansion]:
        expansions = [d.expand(frontier) for d in self.drafters]
        for d, e in zip(self.drafters, expansions):
            if e.tokens.shape != (*frontier.nodes.shape, frontier.k):
                raise ValueError(f"{type(d).__name__}.expand returned tokens of shape {tuple(e.tokens.shape)}; "
                                 f"expected [B, F, k] = {(*frontier.nodes.shape, frontier.k)}")
            if frontier.want_probs and e.probs is None:
                raise ValueError(f"{type(d).__name__} gave no draft probabilities; sampled drafting "
                                 f"(want_probs) needs every combined drafter to return probs")
        return expansions

    def _features_for(self, drafter: Drafter, features: TargetFeatures) -> TargetFeatures:
        wanted = drafter.needs.layer_taps
        if features.taps is None or wanted == self.needs.layer_taps:
            return features
        cols = [self.needs.layer_taps.index(t) for t in wanted]
        taps = [rearrange(t, "n (l h) -> n l h", l=len(self.needs.layer_taps))[:, cols].flatten(1)
                for t in features.taps] if wanted else None
        return dataclasses.replace(features, taps=taps)


@DRAFTERS.register("union", config=UnionConfig)
class UnionDrafter(DrafterGroup):
    """Children proposed by any drafter: deduplicated by token, each with its best log-prob
    over the drafters, sorted descending and cut to k. With ``want_probs``, q is the sum of the
    drafters' q rows, normalised: each row weighs its mass, so q is the average over the drafters
    that proposed something for that node where their rows sum to 1 (every built-in's do).
    """

    def expand(self, frontier: Frontier) -> Expansion:
        expansions = self.expand_all(frontier)
        tokens = torch.cat([e.tokens for e in expansions], -1)       # [B, F, D*k]
        logprobs = torch.cat([e.logprobs for e in expansions], -1)   # [B, F, D*k]
        logprobs, order = logprobs.sort(dim=-1, descending=True, stable=True)
        tokens = tokens.gather(-1, order)
        # after the sort a token's first finite entry carries its max log-prob: drop later copies
        m = tokens.shape[-1]
        same = tokens.unsqueeze(-1) == tokens.unsqueeze(-2)          # [B, F, M, M]
        earlier = torch.ones(m, m, dtype=torch.bool, device=tokens.device).tril(-1)
        dup = (same & earlier & (logprobs > -math.inf).unsqueeze(-2)).any(-1)  # [B, F, M]
        logprobs, order = logprobs.masked_fill(dup, -math.inf).sort(dim=-1, descending=True, stable=True)
        tokens = tokens.gather(-1, order)
        probs = None
        if frontier.want_probs:
            mixture = torch.stack([e.probs for e in expansions]).sum(0)  # [B, F, V]
            # (a drafter that proposed nothing has a row of zeros: it takes no share)
            probs = mixture / mixture.sum(-1, keepdim=True).clamp(min=1e-30)
        return Expansion(tokens=tokens[..., :frontier.k], logprobs=logprobs[..., :frontier.k],
                         probs=probs)


@DRAFTERS.register("fallback", config=FallbackConfig)
class FallbackDrafter(DrafterGroup):
    """Per request and frontier node, the whole answer of the first drafter that proposes any child
    (e.g. n-gram lookup first, a draft model where the lookup finds nothing)."""

    def expand(self, frontier: Frontier) -> Expansion:
        expansions = self.expand_all(frontier)
        has_child = torch.stack([(e.logprobs > -math.inf).any(-1) for e in expansions])  # [D, B, F]
        choice = has_child.int().argmax(0)  # [B, F] first drafter with a child (0 when none has)

        def pick(stacked: torch.Tensor) -> torch.Tensor:  # [D, B, F, X] -> [B, F, X]
            index = choice.view(1, *choice.shape, 1).expand(1, *stacked.shape[1:])
            return stacked.gather(0, index)[0]

        return Expansion(
            tokens=pick(torch.stack([e.tokens for e in expansions])),
            logprobs=pick(torch.stack([e.logprobs for e in expansions])),
            probs=pick(torch.stack([e.probs for e in expansions])) if frontier.want_probs else None,
        )
