"""Lightning recipes that train a target, a draft model and drafter heads (``specflow train``).

Importing the package registers the built-in recipes: ``lm`` (pretraining), ``distill`` (a
draft model), ``eagle``, ``eagle3`` and ``medusa`` (drafter heads).
"""

from specflow.train import eagle, eagle3, lm, medusa  # noqa: F401  (registers recipes)
from specflow.train.config import RECIPES, TrainConfig, load_train_config
from specflow.train.trainer import train

__all__ = ["RECIPES", "TrainConfig", "load_train_config", "train"]
