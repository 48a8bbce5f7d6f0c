"""EAGLE-1/2 head training (Li et al., 2024; SafeAILab/EAGLE ``train/main.py``).

Data: the frozen target runs over each chunk ``x_0 .. x_S`` and records its final hidden
states ``f_j``. The head's row j reads token ``x_{j+1}`` with feature ``f_j`` (plus uniform
noise) at rotary position j, exactly as the drafter feeds it, and learns

    loss = feature_weight * SmoothL1(head_j, f_{j+1})
         + logit_weight  * soft-CE(lm_head(head_j), softmax(lm_head(f_{j+1})))

through the target's frozen embedding and lm_head.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specflow.config import check_at_least
from specflow.models import LlamaForCausalLM
from specflow.models.eagle import EagleHead, new_head_config, save_eagle
from specflow.models.loader import resolve_dtype
from specflow.train.attention import CausalAttention
from specflow.train.config import RECIPES, OptimConfig, TrainConfig, TrainJob
from specflow.train.heads import head_data, meta_target, target_pass
from specflow.train.module import TrainModule, count_params, frozen, soft_cross_entropy


@dataclass
class EagleRecipeConfig:
    """EAGLE-1/2 head: ``num_layers`` Llama layers over fc(cat(embed, feature))."""

    num_layers: int = 1
    bias: bool = True                      # fc bias (the EAGLE-1 layout's default)
    feature_weight: float = 1.0
    logit_weight: float = 0.1
    # width of the uniform noise added to input features, as given (SafeAILab's AddUniformNoise
    # scales its 0.2 by 512 / sequence length: set 0.4 at seq_len 256 to match it)
    noise: float = 0.2
    save_dtype: str = "float32"
    save_format: str = "safetensors"       # or "bin": torch files, for loaders that read only those

    def __post_init__(self):
        check_at_least(self, 1, "num_layers")
        if not (self.feature_weight >= 0 and self.logit_weight >= 0 and self.feature_weight + self.logit_weight > 0):
            raise ValueError(f"feature_weight and logit_weight must be >= 0, one of them > 0 (else nothing is "
                             f"learnt), got {self.feature_weight} and {self.logit_weight}")
        if not self.noise >= 0:
            raise ValueError(f"noise must be >= 0 (the width of the uniform noise on input features), got {self.noise}")


def new_eagle_head(target: LlamaForCausalLM, num_layers: int, bias: bool) -> EagleHead:
    """A freshly initialised head over ``target``'s embedding and lm_head (its layers copy the
    target's layer shape)."""
    return EagleHead(new_head_config(target.config, num_layers), target.embed_tokens, target.lm_head, bias=bias)


def uniform_noise(x: Tensor, width: float) -> Tensor:
    """x + U(-width / 2, width / 2) (EAGLE's feature augmentation)."""
    return x + (torch.rand_like(x) - 0.5) * width if width else x


class EagleModule(TrainModule):
    """Trains ``head`` against the frozen ``target`` (see module docstring)."""

    def __init__(self, head: EagleHead, target: LlamaForCausalLM, optim: OptimConfig, *,
                 feature_weight: float = 1.0, logit_weight: float = 0.1, noise: float = 0.2):
        super().__init__(optim)
        self.head = head
        self.target = frozen(target)
        self.feature_weight, self.logit_weight, self.noise = feature_weight, logit_weight, noise

    def trainable(self) -> nn.Module:
        return self.head

    def losses(self, batch: Tensor) -> dict[str, Tensor]:
        b, s = batch.shape[0], batch.shape[1] - 1
        feats, probs, _ = target_pass(self.target, batch)              # [B, S+1, H], [B, S+1, V]
        noise = self.noise if self.training else 0.0
        inputs = uniform_noise(feats[:, :-1], noise).reshape(b * s, -1)  # [B*S, H]: f_j
        positions = torch.arange(s, device=batch.device).repeat(b)     # [B*S]
        pred, _ = self.head(batch[:, 1:].reshape(-1), positions, CausalAttention(b, s),
                            features=inputs)                           # [B*S, H]: predicts f_{j+1}
        want = feats[:, 1:].reshape(b * s, -1)
        p = probs[:, 1:].reshape(b * s, -1)                             # [B*S, V]: x_{j+2}
        logits = self.head.compute_logits(pred)
        feature = F.smooth_l1_loss(pred.float(), want.float())
        soft = soft_cross_entropy(logits, p)
        acc = (logits.argmax(-1) == p.argmax(-1)).float().mean()
        return {"loss": self.feature_weight * feature + self.logit_weight * soft,
                "feature": feature, "soft_ce": soft, "acc": acc}


@RECIPES.register("eagle", config=EagleRecipeConfig)
class EagleRecipe:
    """An EAGLE-1/2 head for ``target``, exported in SafeAILab/EAGLE's layout."""

    def __init__(self, cfg: EagleRecipeConfig):
        self.cfg = cfg

    @classmethod
    def from_config(cls, cfg: EagleRecipeConfig, **_) -> "EagleRecipe":
        return cls(cfg)

    def setup(self, run: TrainConfig) -> TrainJob:
        data = head_data(run, "eagle")
        head = new_eagle_head(data.target, self.cfg.num_layers, self.cfg.bias)
        module = EagleModule(head, data.target, run.optim, feature_weight=self.cfg.feature_weight,
                             logit_weight=self.cfg.logit_weight, noise=self.cfg.noise)
        return TrainJob(module, data.train, data.val, {**data.info, "params": count_params(head)})

    def export(self, run: TrainConfig, state: dict[str, Tensor], out: Path) -> None:
        head = new_eagle_head(meta_target(run.target), self.cfg.num_layers, self.cfg.bias)
        head.load_state_dict({k.removeprefix("head."): v for k, v in state.items() if k.startswith("head.")})
        save_eagle(head.to(resolve_dtype(self.cfg.save_dtype, {})), out, format=self.cfg.save_format)
