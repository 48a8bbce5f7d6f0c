"""Training configs: the recipe registry and the typed config of one ``specflow train`` run.

A training config names a recipe (``recipe: {type: eagle, ...}``) and shares everything else:
data, optimiser and Lightning trainer settings (accelerator, devices, strategy, num_nodes, so
DDP / FSDP / multi-node need no code change). Loss curves land in ``log_dir`` as
``metrics.csv`` + ``loss.png``; the trained weights are exported in their public layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.utils.data import Dataset

from specflow.config import ConfigError, check_at_least, component_config, load_yaml, validate
from specflow.models.loader import resolve_dtype
from specflow.registry import Registry
from specflow.train.data import DataConfig

RECIPES = Registry("recipe", """\
A training recipe builds a LightningModule and its data, and exports the result.
  from_config(cfg, **_)           - the recipe from its validated config
  check(cfg, run)                 - optional staticmethod: a ConfigError for settings only the run can judge
                                    (data.seq_len, the target's config.json), before anything loads
  setup(run) -> TrainJob          - module, training dataset, validation dataset (or None)
  export(run, state, out)         - write the public checkpoint layout from the module's full state dict""")


@dataclass
class OptimConfig:
    """AdamW with linear warmup, then cosine decay to ``min_lr_ratio * lr`` at ``trainer.max_steps``."""

    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    warmup_steps: int = 100
    batch_size: int = 16

    def __post_init__(self):
        check_at_least(self, 0, "warmup_steps")
        check_at_least(self, 1, "batch_size")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1) (AdamW's beta1, beta2), got {list(self.betas)}")


@dataclass
class TrainerConfig:
    """Lightning ``Trainer`` settings; ``strategy`` (ddp, fsdp, ...), ``devices`` and ``num_nodes``
    scale a recipe out with no code change. ``num_threads`` caps torch's CPU threads (None: leave).

    ``checkpoint_every_n_steps`` saves the whole training state (weights, optimiser, schedule,
    step) to ``<log_dir>/checkpoints/last.ckpt`` every that many steps and when training stops;
    ``resume`` (``last``: that file, or a ``.ckpt`` path) continues a run from one, up to this
    config's ``max_steps``, continuing the data order (mid-epoch included) and the RNG state: on one
    process it ends with the weights of a run never stopped.
    """

    accelerator: str = "auto"
    devices: Any = "auto"
    strategy: str = "auto"
    num_nodes: int = 1
    precision: str = "32-true"
    max_steps: int = 1000
    max_time: str | None = None            # "DD:HH:MM:SS" of each part of a run (a resumed one: afresh);
                                           # stops when a step ends, whatever max_steps says
    val_check_interval: int | None = None  # steps between validations (None: end of each epoch)
    limit_val_batches: int | None = None
    log_every_n_steps: int = 10
    gradient_clip_val: float | None = 1.0
    gradient_clip_algorithm: str = "norm"    # or "value" (SafeAILab's EAGLE-1 main.py: value 0.5;
                                            # traineagle3's DeepSpeed: norm 0.5)
    accumulate_grad_batches: int = 1
    enable_progress_bar: bool = True
    num_threads: int | None = None
    num_workers: int = 0
    checkpoint_every_n_steps: int | None = None
    resume: str | None = None

    def __post_init__(self):
        check_at_least(self, 1, "accumulate_grad_batches", "log_every_n_steps", "val_check_interval",
                       "checkpoint_every_n_steps")
        if self.max_steps != -1:   # (0 would export the untrained weights as a trained head)
            check_at_least(self, 1, "max_steps")
        if self.gradient_clip_algorithm not in ("norm", "value"):
            raise ValueError(f"gradient_clip_algorithm '{self.gradient_clip_algorithm}' is not one of norm, value")

    def compute_dtype(self) -> torch.dtype:
        """What ``precision`` computes in: bfloat16 or float16 under "bf16-mixed", "16-mixed",
        "bf16-true" and the like, float32 otherwise. A frozen target loads in it (its matmuls run
        in it under autocast anyway, and an 8B target then holds 16 GB, not 32), and writes the
        training continuations in it."""
        return {"bf16": torch.bfloat16, "16": torch.float16}.get(str(self.precision).split("-")[0], torch.float32)


@dataclass
class TrainConfig:
    """One training run: a recipe against an (optional) target, with shared data/optim/trainer."""

    name: str = "train"
    output_dir: str = "???"                # the exported checkpoint directory
    target: str | None = None              # the target checkpoint (distillation and heads)
    seed: int = 0
    recipe: Any = field(default_factory=lambda: {"type": "lm"})
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    log_dir: str | None = None             # loss curves and resolved config (default runs/train/<name>)

    def log_path(self) -> Path:
        """``log_dir``, or its default runs/train/<name>."""
        return Path(self.log_dir or Path("runs/train") / self.name)


@dataclass
class TrainJob:
    """What a recipe's ``setup`` returns."""

    module: Any                            # a LightningModule
    train_data: Dataset
    val_data: Dataset | None = None
    info: dict = field(default_factory=dict)   # provenance for the summary (corpus, sizes, ...)


class Recipe(Protocol):
    def setup(self, run: TrainConfig) -> TrainJob: ...
    def export(self, run: TrainConfig, state: dict[str, Tensor], out: Path) -> None: ...


def load_train_config(path: str | Path, overrides: list[str] | None = None) -> TrainConfig:
    """Validate a training YAML (+ ``key=value`` overrides); the recipe node against its recipe."""
    cfg = validate(TrainConfig, load_yaml(path, overrides), "train")
    recipe_cls, recipe = component_config(RECIPES, cfg.recipe, "train.recipe")   # fail now, not after training
    try:
        resolve_dtype(getattr(recipe, "save_dtype", "auto"), {})
    except ValueError as e:
        raise ConfigError(f"train.recipe.save_dtype: {e}") from None
    if getattr(recipe, "save_format", "safetensors") not in ("safetensors", "bin"):
        raise ConfigError(f"train.recipe.save_format: '{recipe.save_format}' is not one of safetensors, bin "
                          f"(pytorch_model.bin; Medusa's medusa_lm_head.pt)")
    if cfg.target is not None and not (Path(cfg.target) / "config.json").exists():
        raise ConfigError(f"train.target: {cfg.target} is not a checkpoint directory (no config.json)")
    check_recipe = getattr(recipe_cls, "check", None)
    if check_recipe is not None:   # settings that only the target and the data can judge
        check_recipe(recipe, cfg)
    return cfg
