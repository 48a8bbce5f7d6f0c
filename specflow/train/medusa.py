"""Medusa head training (Cai et al., 2024; FasterDecoding/Medusa ``train_legacy.py``), base frozen.

Every head reads the frozen target's final hidden state ``h_t``; head i learns token ``x_{t+2+i}``
with cross-entropy, weighted by ``decay ** i`` (0.8: the farther heads, harder to fit, weigh
less; ``train_legacy.py`` sums them unweighted, which is ``decay: 1.0``). As Medusa does, each
ResBlock starts at zero (an identity) and each head's vocabulary projection starts as a copy of
the target's lm_head.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specflow.config import ConfigError, check_at_least
from specflow.models import LlamaForCausalLM
from specflow.models.loader import load_config, resolve_dtype
from specflow.models.medusa import MedusaHeads, save_medusa
from specflow.train.config import RECIPES, OptimConfig, TrainConfig, TrainJob
from specflow.train.heads import head_data
from specflow.train.lm import causal_forward
from specflow.train.module import TrainModule, count_params, frozen


@dataclass
class MedusaRecipeConfig:
    """``num_heads`` Medusa heads of ``num_layers`` ResBlocks each."""

    num_heads: int = 4
    num_layers: int = 1
    decay: float = 0.8                     # head i's loss weight is decay ** i
    save_dtype: str = "float32"
    save_format: str = "safetensors"       # or "bin": torch files, for loaders that read only those

    def __post_init__(self):
        check_at_least(self, 1, "num_heads", "num_layers")
        if not self.decay > 0:
            raise ValueError(f"decay must be > 0 (head i's loss weight is decay ** i), got {self.decay}")


def new_medusa_heads(target: LlamaForCausalLM, num_heads: int, num_layers: int) -> MedusaHeads:
    """Heads initialised as Medusa does: zero ResBlocks, lm_head copies (each head predicts what
    the target's own head would, until trained)."""
    cfg = target.config
    heads = MedusaHeads(cfg.hidden_size, cfg.vocab_size, num_heads, num_layers)
    for head in heads:
        for block in head[:-1]:
            nn.init.zeros_(block.linear.weight)
            nn.init.zeros_(block.linear.bias)
        head[-1].weight.data.copy_(target.lm_head.weight.data)
    return heads


class MedusaModule(TrainModule):
    """Trains ``heads`` on the frozen ``target``'s hidden states (see module docstring)."""

    def __init__(self, heads: MedusaHeads, target: LlamaForCausalLM, optim: OptimConfig, decay: float = 0.8):
        super().__init__(optim)
        self.heads = heads
        self.target = frozen(target)
        self.decay = decay

    def trainable(self) -> nn.Module:
        return self.heads

    def losses(self, batch: Tensor) -> dict[str, Tensor]:
        s = batch.shape[1] - 1
        with torch.no_grad():   # (no target probabilities: a [B, S, V] float32 tensor no loss reads)
            hidden, _ = causal_forward(self.target, batch[:, :-1])          # [B, S, H]: h_t
        logits = self.heads(hidden)                                         # [nh, B, S, V]
        out: dict[str, Tensor] = {}
        total = hidden.new_zeros(())
        for i in range(self.heads.num_heads):
            labels = batch[:, 2 + i :]                                      # [B, S-1-i]: x_{t+2+i}
            li = logits[i][:, : s - 1 - i]                                  # rows t whose label exists
            ce = F.cross_entropy(li.flatten(0, 1).float(), labels.reshape(-1))
            out[f"ce_{i}"] = ce
            out[f"acc_{i}"] = (li.argmax(-1) == labels).float().mean()
            total = total + self.decay ** i * ce
        return {"loss": total, **out}


@RECIPES.register("medusa", config=MedusaRecipeConfig)
class MedusaRecipe:
    """Medusa heads for ``target``, exported in FasterDecoding/Medusa's layout."""

    def __init__(self, cfg: MedusaRecipeConfig):
        self.cfg = cfg

    @classmethod
    def from_config(cls, cfg: MedusaRecipeConfig, **_) -> "MedusaRecipe":
        return cls(cfg)

    @staticmethod
    def check(cfg: MedusaRecipeConfig, run: TrainConfig) -> None:
        """Head i learns x_{t+2+i}: with num_heads >= seq_len the last head has no label in a
        sequence, and its cross-entropy over no rows is NaN (the whole loss, then the weights)."""
        if cfg.num_heads >= run.data.seq_len:
            raise ConfigError(f"train.recipe.num_heads: head {cfg.num_heads - 1} predicts {cfg.num_heads + 1} "
                              f"tokens ahead, past a sequence of {run.data.seq_len}; set recipe.num_heads "
                              f"below data.seq_len")

    def setup(self, run: TrainConfig) -> TrainJob:
        data = head_data(run, "medusa")
        heads = new_medusa_heads(data.target, self.cfg.num_heads, self.cfg.num_layers)
        module = MedusaModule(heads, data.target, run.optim, decay=self.cfg.decay)
        return TrainJob(module, data.train, data.val, {**data.info, "params": count_params(heads)})

    def export(self, run: TrainConfig, state: dict[str, Tensor], out: Path) -> None:
        cfg = load_config(run.target)
        with torch.device("meta"):
            heads = MedusaHeads(cfg.hidden_size, cfg.vocab_size, self.cfg.num_heads, self.cfg.num_layers)
        heads.load_state_dict({k.removeprefix("heads."): v for k, v in state.items() if k.startswith("heads.")},
                              assign=True)
        save_medusa(heads.to(resolve_dtype(self.cfg.save_dtype, {})), out, format=self.cfg.save_format,
                    base_model_name_or_path=run.target)
