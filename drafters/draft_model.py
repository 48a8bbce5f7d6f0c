"""A smaller Llama-family model sharing the target's tokenizer drafts the tree (SpS / SpecInfer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from specflow.config import check_at_least
from specflow.models import CheckpointError, load_model
from specflow.protocols import TargetFeatures, TargetNeeds
from specflow.registry import DRAFTERS
from specflow.runtime.beam import Beam
from specflow.runtime.draft_runner import TreeDraftRunner
from specflow.runtime.model_runner import RuntimeOptions
from specflow.tree import Expansion, Frontier, Roots, Verdict


@dataclass
class DraftModelConfig:
    path: str = "???"               # any Llama-family HF checkpoint with the target's vocabulary
    kv_cache_tokens: int = 65536    # the draft model's own paged KV pool
    page_size: int = 1

    def __post_init__(self):        # (runs when the config is validated: before the target loads)
        check_at_least(self, 1, "kv_cache_tokens", "page_size")


@DRAFTERS.register("draft_model", config=DraftModelConfig)
class DraftModelDrafter:
    """Runs a draft model on its own paged KV cache; each ``expand`` feeds the frontier nodes
    with tree attention, so chains, static trees and EAGLE-2 trees all work; EAGLE-2's levels
    after the root run as a ``beam`` (one CUDA graph with graphs on)."""

    needs = TargetNeeds()

    def __init__(self, model: torch.nn.Module, *, target_vocab_size: int | None = None,
                 kv_cache_tokens: int = 65536, page_size: int = 1, runtime: RuntimeOptions | None = None):
        vocab = model.config.vocab_size
        if target_vocab_size is not None and vocab != target_vocab_size:
            raise CheckpointError(f"draft model vocabulary ({vocab}) differs from the target's "
                                  f"({target_vocab_size}); a draft model must share the tokenizer")
        self.vocab_size = vocab
        runtime = runtime or RuntimeOptions()
        self.runner = TreeDraftRunner(runtime.runner(model, num_pages=max(1, kv_cache_tokens // page_size),
                                                     page_size=page_size), max_feed=runtime.max_prefill_tokens)

    @classmethod
    def from_config(cls, cfg: DraftModelConfig, *, vocab_size: int | None = None, device: Any = "cpu",
                    dtype: Any = torch.float32, runtime: RuntimeOptions | None = None,
                    **_: Any) -> "DraftModelDrafter":
        return cls(load_model(cfg.path, device=device, dtype=dtype), target_vocab_size=vocab_size,
                   kv_cache_tokens=cfg.kv_cache_tokens, page_size=cfg.page_size, runtime=runtime)

    def begin(self, features: TargetFeatures) -> None:
        for rid, tokens in zip(features.request_ids, features.tokens):
            self.runner.add_pending(rid, tokens.tolist())

    def expand(self, frontier: Frontier) -> Expansion:
        return self.runner.expand(frontier, self.runner.runner.model.compute_logits, self.vocab_size)

    def beam(self, roots: Roots, k: int, levels: int) -> Beam | None:
        """An EAGLE-2 build over branch K/V paths: the roots expanded, then ``levels`` more
        (specflow.runtime.beam); None where this model's cache cannot (the builder then expands
        level by level)."""
        return self.runner.beam(roots, k, levels, self.runner.runner.model.compute_logits, self.vocab_size)

    def commit(self, verdict: Verdict, features: TargetFeatures) -> None:
        self.runner.commit(features.request_ids, [t.tolist() for t in features.tokens])

    def release(self, request_ids: list[int]) -> None:
        self.runner.release(request_ids)
