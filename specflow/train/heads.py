"""What every head recipe shares: the frozen target, its tokenizer and data, and the target pass
that records the features a head learns from."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from specflow.config import ConfigError
from specflow.models import LlamaForCausalLM
from specflow.models.loader import load_config
from specflow.train.config import TrainConfig
from specflow.train.data import ChunkDataset, target_tokenizer, training_chunks
from specflow.train.lm import causal_forward
from specflow.train.module import frozen_target


@dataclass
class HeadData:
    target: LlamaForCausalLM            # frozen
    train: ChunkDataset
    val: ChunkDataset | None
    info: dict


def head_data(run: TrainConfig, recipe: str) -> HeadData:
    """Load ``run.target`` (frozen, in the dtype the run computes in) and cut its tokenizer's view of
    the data into chunks."""
    if run.target is None:
        raise ConfigError(f"recipe '{recipe}' needs 'target': the checkpoint the head drafts for")
    tokenizer = target_tokenizer(run.target)
    target = frozen_target(run.target, run.trainer.compute_dtype())
    train, val, info = training_chunks(run, tokenizer, vocab_size=target.config.vocab_size)
    return HeadData(target, train, val, info)


def meta_target(path: str | Path) -> LlamaForCausalLM:
    """The target of ``path`` on the meta device, from its config alone: what an export needs of it
    (shapes, the modules a head references) without reading its weights a second time (the trained
    module still holds them: an 8B float32 target is another 32 GB)."""
    with torch.device("meta"):
        return LlamaForCausalLM(load_config(path))


@torch.no_grad()
def target_pass(target: LlamaForCausalLM, tokens: Tensor,
                taps: tuple[int, ...] = ()) -> tuple[Tensor, Tensor, list[Tensor]]:
    """The frozen target over ``tokens [B, S + 1]``: final hidden ``[B, S + 1, H]``, next-token
    probabilities ``[B, S + 1, V]`` (float32) and the tapped layer inputs ``[B, S + 1, H]`` each."""
    hidden, tapped = causal_forward(target, tokens, taps)
    probs = target.compute_logits(hidden).float().softmax(-1)
    return hidden, probs, tapped
