"""The shared LightningModule base of every recipe: optimiser, schedule, logged losses."""

from __future__ import annotations

import math
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specflow.models import LlamaForCausalLM, load_model
from specflow.train.config import OptimConfig


def soft_cross_entropy(logits: Tensor, target_probs: Tensor) -> Tensor:
    """Mean over rows of -sum_v p(v) log q(v); ``logits``/``target_probs`` are ``[..., V]``."""
    return -(target_probs * F.log_softmax(logits.float(), dim=-1)).sum(-1).mean()


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup: int, total: int, min_ratio: float):
    """LambdaLR: linear warmup over ``warmup`` steps, cosine to ``min_ratio`` at ``total``."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class TrainModule(L.LightningModule):
    """A recipe's module: ``losses(batch)`` returns named scalars including ``loss`` (optimised);
    AdamW over ``trainable()`` (no decay on norms and biases) with warmup-cosine; every loss is
    logged as ``train/<name>`` and ``val/<name>``."""

    def __init__(self, optim: OptimConfig):
        super().__init__()
        self.optim = optim

    def trainable(self) -> nn.Module:
        raise NotImplementedError

    def configure_optimizers(self):
        params = [p for p in self.trainable().parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": self.optim.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}],
                                lr=self.optim.lr, betas=tuple(self.optim.betas))
        total = self.trainer.max_steps if self.trainer.max_steps > 0 else 10_000
        sched = warmup_cosine(opt, self.optim.warmup_steps, total, self.optim.min_lr_ratio)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def losses(self, batch: Tensor) -> dict[str, Tensor]:
        raise NotImplementedError

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        out = self.losses(batch)
        self.log_dict({f"train/{k}": v for k, v in out.items()}, prog_bar=True, batch_size=len(batch))
        return out["loss"]

    def validation_step(self, batch: Tensor, batch_idx: int) -> None:
        out = self.losses(batch)
        self.log_dict({f"val/{k}": v for k, v in out.items()}, prog_bar=True, batch_size=len(batch),
                      sync_dist=True)


def count_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def frozen(model: nn.Module) -> nn.Module:
    """``model`` in eval mode with no gradients to its parameters (a target read by a recipe)."""
    return model.requires_grad_(False).eval()


def frozen_target(path: str | Path, dtype: torch.dtype) -> LlamaForCausalLM:
    """The checkpoint at ``path``, frozen, in ``dtype`` (``TrainerConfig.compute_dtype``)."""
    return frozen(load_model(path, dtype=dtype))
