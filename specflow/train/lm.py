"""Causal-LM training of native Llama models: pretraining a target from scratch, and distilling a
small draft model from a target (soft cross-entropy against the target's next-token distribution).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AutoTokenizer

from specflow.config import ConfigError, check_at_least
from specflow.models import LlamaForCausalLM, ModelConfig, save_model
from specflow.models.loader import resolve_dtype
from specflow.train.attention import CausalAttention
from specflow.train.config import RECIPES, OptimConfig, TrainConfig, TrainJob
from specflow.train.data import target_tokenizer, training_chunks
from specflow.train.module import TrainModule, count_params, frozen, frozen_target, soft_cross_entropy


@dataclass
class ModelShape:
    """Architecture of a Llama model trained from scratch (the vocabulary comes from the tokenizer)."""

    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int | None = None
    intermediate_size: int | None = None   # default: 8/3 * hidden, rounded up to a multiple of 64
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    init_std: float = 0.02

    def __post_init__(self):
        check_at_least(self, 1, "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                       "max_position_embeddings")


def build_llama(shape: ModelShape, vocab_size: int, eos_token_id: int, seed: int) -> LlamaForCausalLM:
    """A freshly initialised native Llama (normal(0, init_std) weights, as transformers does)."""
    inter = shape.intermediate_size or 64 * math.ceil(8 * shape.hidden_size / 3 / 64)
    cfg = ModelConfig(arch="llama", vocab_size=vocab_size, hidden_size=shape.hidden_size,
                      intermediate_size=inter, num_hidden_layers=shape.num_layers,
                      num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
                      rms_norm_eps=1e-6, rope_theta=shape.rope_theta,
                      max_position_embeddings=shape.max_position_embeddings,
                      tie_word_embeddings=shape.tie_word_embeddings,
                      bos_token_id=eos_token_id, eos_token_ids=[eos_token_id])
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=shape.init_std)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
    model.tie_weights()
    return model


def causal_forward(model: LlamaForCausalLM, input_ids: Tensor,
                   taps: tuple[int, ...] = ()) -> tuple[Tensor, list[Tensor]]:
    """Run a native model over ``input_ids [B, S]`` with causal attention (windowed for a model
    with a ``sliding_window``, as at inference).

    Returns the final normed hidden states ``[B, S, H]`` and the tapped states, each ``[B, S, H]``.
    """
    b, s = input_ids.shape
    positions = torch.arange(s, device=input_ids.device).repeat(b)                 # [B*S]
    attn = CausalAttention(b, s, model.config.sliding_window)
    hidden, tapped = model(input_ids.reshape(-1), positions, attn, taps)
    return hidden.view(b, s, -1), [t.view(b, s, -1) for t in tapped]


class CausalLMModule(TrainModule):
    """Next-token training of ``model``; with a ``teacher``, the loss is
    ``alpha * soft-CE(teacher probs) + (1 - alpha) * CE(labels)`` (draft-model distillation)."""

    def __init__(self, model: LlamaForCausalLM, optim: OptimConfig,
                 teacher: LlamaForCausalLM | None = None, alpha: float = 1.0):
        super().__init__(optim)
        self.model = model
        self.teacher = frozen(teacher) if teacher is not None else None
        self.alpha = alpha

    def trainable(self) -> nn.Module:
        return self.model

    def losses(self, batch: Tensor) -> dict[str, Tensor]:
        inputs, labels = batch[:, :-1], batch[:, 1:]                         # [B, S] each
        hidden, _ = causal_forward(self.model, inputs)
        logits = self.model.compute_logits(hidden)                          # [B, S, V]
        ce = F.cross_entropy(logits.flatten(0, 1).float(), labels.reshape(-1))
        out = {"ce": ce, "loss": ce}
        if self.teacher is not None:
            with torch.no_grad():
                t_hidden, _ = causal_forward(self.teacher, inputs)
                t_probs = self.teacher.compute_logits(t_hidden).float().softmax(-1)  # [B, S, V]
            soft = soft_cross_entropy(logits, t_probs)
            out["soft_ce"] = soft
            out["loss"] = self.alpha * soft + (1 - self.alpha) * ce
        return out


@dataclass
class LMRecipeConfig:
    """Pretrain a Llama from scratch on the corpus with the BPE tokenizer in ``tokenizer``."""

    tokenizer: str = "???"                 # a directory with tokenizer.json (+ config); copied to the output
    model: ModelShape = field(default_factory=ModelShape)
    save_dtype: str = "float32"


@dataclass
class DistillRecipeConfig:
    """Distil a small draft model from ``target`` (which also provides the tokenizer)."""

    model: ModelShape = field(default_factory=lambda: ModelShape(hidden_size=128, num_layers=2, num_heads=2))
    alpha: float = 1.0                     # weight of soft-CE(target) against CE(labels)
    save_dtype: str = "float32"

    def __post_init__(self):
        if not 0 <= self.alpha <= 1:
            raise ValueError(f"alpha must be in [0, 1] (the weight of soft-CE(target) against CE(labels)), "
                             f"got {self.alpha}")


def export_llama(state: dict[str, Tensor], cfg: ModelConfig, out: Path, dtype: str, tokenizer_dir: str | Path) -> None:
    """Write a plain Hugging Face Llama checkpoint (config, safetensors, tokenizer) from ``model.*`` keys."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    weights = {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
    if cfg.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    model.load_state_dict(weights, strict=not cfg.tie_word_embeddings, assign=True)
    model.tie_weights()
    save_model(model.to(resolve_dtype(dtype, {})), out)
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(str(out))


@RECIPES.register("lm", config=LMRecipeConfig)
class LMRecipe:
    """Causal-LM pretraining of a target model from scratch."""

    def __init__(self, cfg: LMRecipeConfig):
        self.cfg = cfg

    @classmethod
    def from_config(cls, cfg: LMRecipeConfig, **_) -> "LMRecipe":
        return cls(cfg)

    def setup(self, run: TrainConfig) -> TrainJob:
        tokenizer = AutoTokenizer.from_pretrained(self.cfg.tokenizer)
        train, val, info = training_chunks(run, tokenizer)
        model = build_llama(self.cfg.model, len(tokenizer), tokenizer.eos_token_id, run.seed)
        self.model_config = model.config
        info["params"] = count_params(model)
        return TrainJob(CausalLMModule(model, run.optim), train, val, info)

    def export(self, run: TrainConfig, state: dict[str, Tensor], out: Path) -> None:
        export_llama(state, self.model_config, out, self.cfg.save_dtype, self.cfg.tokenizer)


@RECIPES.register("distill", config=DistillRecipeConfig)
class DistillRecipe:
    """A draft model trained on the target's next-token distributions (soft cross-entropy)."""

    def __init__(self, cfg: DistillRecipeConfig):
        self.cfg = cfg

    @classmethod
    def from_config(cls, cfg: DistillRecipeConfig, **_) -> "DistillRecipe":
        return cls(cfg)

    def setup(self, run: TrainConfig) -> TrainJob:
        if run.target is None:
            raise ConfigError("recipe 'distill' needs 'target': the checkpoint to distil from")
        tokenizer = target_tokenizer(run.target)
        teacher = frozen_target(run.target, run.trainer.compute_dtype())
        train, val, info = training_chunks(run, tokenizer, vocab_size=teacher.config.vocab_size)
        model = build_llama(self.cfg.model, teacher.config.vocab_size, tokenizer.eos_token_id, run.seed)
        self.model_config = model.config
        info["params"] = count_params(model)
        return TrainJob(CausalLMModule(model, run.optim, teacher=teacher, alpha=self.cfg.alpha), train, val, info)

    def export(self, run: TrainConfig, state: dict[str, Tensor], out: Path) -> None:
        export_llama(state, self.model_config, out, self.cfg.save_dtype, run.target)
