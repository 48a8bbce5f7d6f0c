"""EAGLE-3 drafter: a head over three target layer taps, with its own (smaller) draft vocabulary
mapped to target ids through ``d2t`` (Li et al., 2025). Drafting, tree attention and the re-sync
after each verdict are EAGLE's (drafters.eagle); what differs is the head and the features."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from drafters.eagle import EagleDrafter
from specflow.config import check_at_least
from specflow.models.eagle3 import Eagle3Head, load_eagle3
from specflow.protocols import TargetFeatures, TargetNeeds
from specflow.registry import DRAFTERS
from specflow.runtime.model_runner import ModelRunner, RuntimeOptions


@dataclass
class Eagle3Config:
    path: str = "???"               # EAGLE-3 head directory (SafeAILab/EAGLE layout, with d2t / t2d)
    kv_cache_tokens: int = 65536    # the head's own paged KV pool
    page_size: int = 1

    def __post_init__(self):        # (runs when the config is validated: before the target loads)
        check_at_least(self, 1, "kv_cache_tokens", "page_size")


@DRAFTERS.register("eagle3", config=Eagle3Config)
class Eagle3Drafter(EagleDrafter):
    """EAGLE drafting with an EAGLE-3 head; ``needs`` the hidden states entering the head's tap
    layers, which the head's ``fc`` projects once per committed token."""

    def __init__(self, head: Eagle3Head, *, kv_cache_tokens: int = 65536, page_size: int = 1,
                 runtime: RuntimeOptions | None = None):
        super().__init__(head, kv_cache_tokens=kv_cache_tokens, page_size=page_size, runtime=runtime)
        self.needs = TargetNeeds(layer_taps=head.taps)

    @classmethod
    def from_config(cls, cfg: Eagle3Config, *, target: ModelRunner, device: Any = "cpu",
                    dtype: Any = torch.float32, runtime: RuntimeOptions | None = None, **_: Any) -> "Eagle3Drafter":
        head = load_eagle3(cfg.path, target.model, device=device, dtype=dtype)
        return cls(head, kv_cache_tokens=cfg.kv_cache_tokens, page_size=cfg.page_size, runtime=runtime)

    def target_features(self, features: TargetFeatures) -> list[Tensor]:
        assert features.taps is not None, "the engine must pass the layer taps (needs.layer_taps)"
        return features.taps
