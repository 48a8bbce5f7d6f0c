"""EAGLE-1/2 drafter: a trained head on the target's features drafts the tree (Li et al., 2024).

The head keeps its own paged KV cache and expands trees with tree attention (chain, static
and EAGLE-2 trees all work). After each verdict it re-syncs over the accepted tokens with their
target features, as SafeAILab/EAGLE and SGLang do (see specflow.runtime.draft_runner). With
``token_map`` (FR-Spec, Zhao et al., 2025) it drafts among a set of frequent tokens only: its
lm_head becomes the target head's rows at those ids. Drafting stays lossless either way: only
the drafts change, never the verification.
"""

from __future__ import annotations

import json
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from specflow.config import check_at_least
from specflow.models import CheckpointError
from specflow.models.eagle import EagleHead, load_eagle
from specflow.protocols import TargetFeatures, TargetNeeds
from specflow.registry import DRAFTERS
from specflow.runtime.beam import Beam
from specflow.runtime.draft_runner import TreeDraftRunner
from specflow.runtime.model_runner import ModelRunner, RuntimeOptions
from specflow.tree import Expansion, Frontier, Roots, Verdict


@dataclass
class EagleConfig:
    path: str = "???"               # EAGLE-1/2 head directory (SafeAILab/EAGLE layout)
    token_map: str | None = None    # FR-Spec hot token ids: a .pt tensor, a .json list or whitespace-separated ids
    kv_cache_tokens: int = 65536    # the head's own paged KV pool
    page_size: int = 1

    def __post_init__(self):        # (runs when the config is validated: before the target loads)
        check_at_least(self, 1, "kv_cache_tokens", "page_size")


def load_token_map(path: str | Path, vocab_size: int) -> Tensor:
    """[M] int64 hot token ids from a file (torch-saved tensor or list, JSON list, or plain text)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"token_map {path} does not exist; give a file of hot token ids")
    try:
        if path.suffix in (".pt", ".pth", ".bin"):
            ids = torch.as_tensor(torch.load(path, map_location="cpu", weights_only=True))
        elif path.suffix == ".json":
            ids = torch.tensor(json.loads(path.read_text()))
        else:
            ids = torch.tensor([int(t) for t in path.read_text().split()])
    except (ValueError, TypeError, RuntimeError, pickle.UnpicklingError, EOFError) as e:
        raise CheckpointError(f"token_map {path} is not a list of token ids: {e}") from None
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:  # (.long() would truncate 1.7 to 1)
        raise CheckpointError(f"token_map {path} must hold integer token ids, got {str(ids.dtype).removeprefix('torch.')}")
    ids = ids.long().flatten()
    if len(ids) == 0 or len(ids.unique()) != len(ids) or ids.min() < 0 or ids.max() >= vocab_size:
        raise CheckpointError(f"token_map {path} must hold distinct token ids in 0..{vocab_size - 1}, "
                              f"got {len(ids)} ids")
    return ids


@DRAFTERS.register("eagle", config=EagleConfig)
class EagleDrafter:
    """Drafts with an EAGLE-style head (``head``: forward over ``features``, ``project``,
    ``compute_logits``, ``draft_to_target``) on its own paged KV cache.

    ``begin``/``commit`` hand the head the target features of committed tokens (``needs``: the
    last hidden state); ``expand`` feeds the frontier nodes, each with the head's output at its
    parent, and answers the top-k of the head's distribution, mapped to target token ids.
    """

    needs = TargetNeeds(last_hidden=True)

    def __init__(self, head: EagleHead, *, kv_cache_tokens: int = 65536, page_size: int = 1,
                 runtime: RuntimeOptions | None = None):
        self.head = head
        self.vocab_size = head.config.vocab_size
        runtime = runtime or RuntimeOptions()
        self.runner = TreeDraftRunner(runtime.runner(head, num_pages=max(1, kv_cache_tokens // page_size),
                                                     page_size=page_size),
                                      features=True, max_feed=runtime.max_prefill_tokens)

    @classmethod
    def from_config(cls, cfg: EagleConfig, *, target: ModelRunner, device: Any = "cpu",
                    dtype: Any = torch.float32, runtime: RuntimeOptions | None = None, **_: Any) -> "EagleDrafter":
        head = load_eagle(cfg.path, target.model, device=device, dtype=dtype)
        if cfg.token_map is not None:
            head.set_token_map(load_token_map(cfg.token_map, head.config.vocab_size))
        return cls(head, kv_cache_tokens=cfg.kv_cache_tokens, page_size=cfg.page_size, runtime=runtime)

    def target_features(self, features: TargetFeatures) -> list[Tensor]:
        """Per request [n, F] target features of the committed tokens, as this head reads them."""
        assert features.hidden is not None, "the engine must pass the last hidden states (needs.last_hidden)"
        return features.hidden

    def projected(self, features: TargetFeatures) -> list[Tensor]:
        """Per request [n, F] features as the head reads them: one ``project`` for the batch."""
        per_request = self.target_features(features)
        return list(self.head.project(torch.cat(per_request)).split([len(f) for f in per_request]))

    @torch.inference_mode()
    def begin(self, features: TargetFeatures) -> None:
        for rid, tokens, f in zip(features.request_ids, features.tokens, self.projected(features)):
            self.runner.add_pending(rid, tokens.tolist(), f)

    def expand(self, frontier: Frontier) -> Expansion:
        return self.runner.expand(frontier, self.head.compute_logits, self.vocab_size, self.head.draft_to_target)

    def beam(self, roots: Roots, k: int, levels: int) -> Beam | None:
        """An EAGLE-2 build over branch K/V paths: the roots expanded, then ``levels`` more
        (specflow.runtime.beam); None where this head's cache cannot (the builder then expands
        level by level)."""
        return self.runner.beam(roots, k, levels, self.head.compute_logits, self.vocab_size, self.head.draft_to_target)

    @torch.inference_mode()
    def commit(self, verdict: Verdict, features: TargetFeatures) -> None:
        self.runner.commit(features.request_ids, [t.tolist() for t in features.tokens], self.projected(features))

    def release(self, request_ids: list[int]) -> None:
        self.runner.release(request_ids)
