"""EAGLE-1/2 draft head in the public layout of SafeAILab/EAGLE (``cnets1.py``), as SGLang's
``LlamaForCausalLMEagle`` loads it.

config.json is a Llama config (usually ``num_hidden_layers: 1``) plus ``bias`` (fc bias,
default true) and optionally ``qkv_bias``. Checkpoint keys::

    fc.weight [H, 2H] (+ fc.bias [H])
    layers.{i}.self_attn.{q,k,v,o}_proj.weight, layers.{i}.mlp.{gate,up,down}_proj.weight
    layers.{i}.post_attention_layernorm.weight, layers.{i}.input_layernorm.weight (i >= 1 only)

Layer 0 has no input_layernorm, there is no final norm and no lm_head: the head reads the
target's ``embed_tokens`` and ``lm_head`` (an ``embed_tokens.weight`` in the file is ignored).

Alignment (``Model.forward`` / ``topK_genrate`` in cnets1.py, SGLang's draft extend): the head's
sequence pairs token x_{j+1} with the target feature f_j of token x_j (the final normed hidden
state) at rotary position j; its output is the predicted feature of x_{j+1}, and the target's
lm_head on it gives the distribution of x_{j+2}. While drafting, a tree node's feature is the
head's output at its parent.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specflow.models.config import ModelConfig
from specflow.models.head_io import Format, assign_state, check_fits, read_head, write_head
from specflow.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, checkpoint_state
from specflow.models.rope import RotaryEmbedding

if TYPE_CHECKING:
    from specflow.runtime.attention import AttentionBackend


def head_config(hf: dict) -> ModelConfig:
    """The Llama architecture of a draft head's config.json (the head layers are Llama layers
    whatever the target family; biases other than ``qkv_bias`` do not exist in the layout)."""
    return ModelConfig.from_hf({**hf, "model_type": "llama", "attention_bias": False, "mlp_bias": False})


def new_head_config(target: ModelConfig, num_layers: int) -> ModelConfig:
    """The config of a new head's layers for ``target``: its shapes in plain Llama layers (no biases,
    no q/k norm, whatever the target family), as ``head_config`` reads the head back."""
    return dataclasses.replace(target, arch="llama", num_hidden_layers=num_layers, tie_word_embeddings=False,
                               attention_bias=False, mlp_bias=False, qk_norm=False, sliding_window=None)


def head_attention(cfg: ModelConfig, layer_idx: int, in_features: int, qkv_bias: bool = False) -> LlamaAttention:
    """A Llama attention whose q/k/v read ``in_features`` (EAGLE-3: 2H) and may carry a bias."""
    return LlamaAttention(cfg, layer_idx, in_features=in_features, qkv_bias=qkv_bias)


class EagleHead(nn.Module):
    """EAGLE-1/2 head over a target's embedding and LM head (see module docstring).

    ``forward(input_ids [T], positions [T], attn, taps=(), *, features [T, H])`` returns the
    predicted features ``[T, H]`` (and no taps); ``compute_logits`` applies the target's lm_head,
    restricted to the FR-Spec hot tokens after ``set_token_map`` (draft ids index the map; use
    ``draft_to_target``). The target's modules are referenced, not owned: ``parameters()`` and
    ``state_dict()`` hold the head's own weights only.
    """

    def __init__(self, cfg: ModelConfig, embed_tokens: nn.Embedding, lm_head: nn.Linear, *,
                 bias: bool = True, qkv_bias: bool = False):
        super().__init__()
        self.config, self.bias, self.qkv_bias = cfg, bias, qkv_bias
        h = cfg.hidden_size
        self.target_modules = (embed_tokens, lm_head)  # a tuple: not registered as submodules
        self.fc = nn.Linear(2 * h, h, bias=bias)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.layers[0].input_layernorm = nn.Identity()  # cnets1: layer 0 reads fc's output as it is
        if qkv_bias:
            for i, layer in enumerate(self.layers):
                layer.self_attn = head_attention(cfg, i, h, qkv_bias=True)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("token_map", None, persistent=False)       # [M] target ids of draft ids
        self.register_buffer("hot_lm_head", None, persistent=False)     # [M, H] lm_head rows at token_map

    @property
    def draft_vocab_size(self) -> int:
        return self.config.vocab_size if self.token_map is None else len(self.token_map)

    def set_token_map(self, token_ids: Tensor | None) -> None:
        """FR-Spec: draft only among ``token_ids`` (the lm_head becomes those rows); None undoes it."""
        if token_ids is None:
            self.token_map = self.hot_lm_head = None
            return
        weight = self.target_modules[1].weight
        self.token_map = token_ids.to(device=weight.device, dtype=torch.long)
        self.hot_lm_head = weight.detach()[self.token_map].clone()

    def project(self, features: Tensor) -> Tensor:
        """Target features as the head reads them (EAGLE-1: the final hidden state as it is)."""
        return features

    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionBackend,
                taps: tuple[int, ...] = (), *, features: Tensor) -> tuple[Tensor, list[Tensor]]:
        assert not taps, "a draft head has no layer taps"
        embeds = self.target_modules[0](input_ids)                        # [T, H]
        x = self.fc(torch.cat([embeds, features.to(embeds.dtype)], -1))   # [T, 2H] -> [T, H]
        rotary = self.rotary_emb(positions, x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, rotary, attn)
        return x + residual, []

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """[..., H] -> [..., draft vocab]."""
        if self.hot_lm_head is not None:
            return F.linear(hidden, self.hot_lm_head)
        return self.target_modules[1](hidden)

    def draft_to_target(self, ids: Tensor) -> Tensor:
        """Draft token ids -> target token ids."""
        return ids if self.token_map is None else self.token_map[ids]


def load_eagle(path: str | Path, target_model: LlamaForCausalLM, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32) -> EagleHead:
    """Load an EAGLE-1/2 head directory for ``target_model``; CheckpointError when it does not fit."""
    hf, state = read_head(path)
    cfg = head_config(hf)
    target = target_model.config
    check_fits("hidden_size", cfg.hidden_size, target.hidden_size, path)
    check_fits("vocab_size", cfg.vocab_size, target.vocab_size, path)
    with torch.device("meta"):
        head = EagleHead(cfg, target_model.embed_tokens, target_model.lm_head,
                         bias=hf.get("bias", True), qkv_bias=hf.get("qkv_bias", False))
    assign_state(head, state, path, ignore={"embed_tokens.weight": (target.vocab_size, target.hidden_size)},
                 device=device, dtype=dtype)
    return head.to(device).eval()


def save_eagle(head: EagleHead, path: str | Path, format: Format = "safetensors") -> Path:
    """Write the head as SafeAILab/EAGLE publishes it: config.json + model.safetensors or
    pytorch_model.bin. The architecture is SGLang's name for this layout (LlamaForCausalLMEagle,
    as in lmsys's sglang-EAGLE checkpoints); vLLM reads the same files with LlamaForCausalLM
    there, as SafeAILab's own heads say (it prefixes "Eagle" to whatever name it finds)."""
    hf = {**head.config.to_hf(), "architectures": ["LlamaForCausalLMEagle"], "bias": head.bias}
    if head.qkv_bias:
        hf["qkv_bias"] = True
    hf["torch_dtype"] = str(next(head.parameters()).dtype).removeprefix("torch.")
    return write_head(path, hf, checkpoint_state(head), format=format)
