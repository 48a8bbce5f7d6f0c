"""A native, token-flat Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3).

Checkpoints use Hugging Face names (``model.layers.{i}.self_attn.q_proj.weight``, ...). Inside,
q/k/v and gate/up are stacked into one Linear each (``PackedProjections``: one GEMM instead of
three or two); ``checkpoint_state`` / ``StackedState`` convert between the two at the file
boundary (loader, heads, exports). The model never touches the KV cache: each
attention layer hands rotated q/k and v to ``attn.forward(layer_idx, q, k, v)``, and the
attention backend (planned by the runner for this forward) caches, masks and attends.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from specflow.models.config import ModelConfig
from specflow.models.kernels import add_rms_norm, rms_norm, rope, silu_and_mul
from specflow.models.rope import Rotary, RotaryEmbedding

if TYPE_CHECKING:
    from specflow.runtime.attention import AttentionBackend


class RMSNorm(nn.Module):
    """RMSNorm over the last dim (``kernels.rms_norm``: as transformers on CPU, flashinfer on CUDA)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """``norm(x)``; given the residual stream, ``(norm(residual + x), residual + x)`` in one
        fused pass (``kernels.add_rms_norm``: may overwrite x and residual)."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)


class PackedProjections(nn.Module):
    """Base of a layer whose Linears may each stack several of a checkpoint's projections of one
    input on the output dim (q/k/v, gate/up): one GEMM instead of several. The module's own state
    dict holds the stacked tensors (``qkv_proj.weight``); ``checkpoint_state`` and ``StackedState``
    convert to and from the checkpoint's names at the file boundary."""

    def __init__(self):
        super().__init__()
        self.packed: dict[str, dict[str, int]] = {}  # attribute -> {checkpoint name: output features}

    def packed_linear(self, name: str, in_features: int, parts: dict[str, int], bias: bool) -> None:
        """``self.<name>``: one Linear for the checkpoint's ``parts``, stacked in their order."""
        self.packed[name] = parts
        setattr(self, name, nn.Linear(in_features, sum(parts.values()), bias=bias))

    def unpack(self, name: str, y: Tensor) -> tuple[Tensor, ...]:
        """``self.<name>``'s output ``[..., sum(parts)]`` -> one ``[..., n]`` view per part."""
        return y.split(list(self.packed[name].values()), dim=-1)


def packed_tensors(model: nn.Module) -> dict[str, list[tuple[str, int]]]:
    """Every stacked tensor of ``model``: its state-dict name -> ``[(checkpoint name, rows), ...]``."""
    out = {}
    for prefix, module in model.named_modules():
        if isinstance(module, PackedProjections):
            for name, parts in module.packed.items():
                for kind, tensor in getattr(module, name).named_parameters():
                    out[f"{prefix}.{name}.{kind}".lstrip(".")] = [
                        (f"{prefix}.{part}.{kind}".lstrip("."), rows) for part, rows in parts.items()]
    return out


def checkpoint_state(model: nn.Module, copy: bool = True) -> dict[str, Tensor]:
    """``model.state_dict()`` under the checkpoint's names: stacked tensors split into their parts
    (copies, as files need; ``copy=False``: views sharing the model's storage)."""
    state = model.state_dict()
    for name, parts in packed_tensors(model).items():
        pieces = state.pop(name).split([rows for _, rows in parts])
        state.update((part, piece.clone() if copy else piece) for (part, _), piece in zip(parts, pieces))
    return state


class StackedState:
    """A checkpoint's tensors (checkpoint names, shapes already checked) gathered into ``model``'s
    own state dict for ``load_state_dict``: each part of a stacked tensor is copied into its rows
    of one tensor as it arrives, so a load holds no tensor twice (the part itself can go)."""

    def __init__(self, model: nn.Module):
        self.state: dict[str, Tensor] = {}
        self.rows: dict[str, tuple[str, int, int]] = {}  # part -> (stacked name, first row, total rows)
        for name, parts in packed_tensors(model).items():
            start, total = 0, sum(rows for _, rows in parts)
            for part, rows in parts:
                self.rows[part] = (name, start, total)
                start += rows

    def add(self, name: str, tensor: Tensor) -> None:
        if name not in self.rows:
            self.state[name] = tensor
            return
        stacked, start, total = self.rows[name]
        if stacked not in self.state:
            self.state[stacked] = tensor.new_empty(total, *tensor.shape[1:])
        self.state[stacked][start : start + len(tensor)].copy_(tensor)


class LlamaAttention(PackedProjections):
    """Projections, optional per-head q/k RMSNorm (Qwen3), RoPE; attention itself is delegated.
    ``in_features`` and ``qkv_bias`` override the config's for draft heads (EAGLE-3 reads 2H)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, in_features: int | None = None,
                 qkv_bias: bool | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.packed_linear("qkv_proj", in_features or cfg.hidden_size, {"q_proj": q_size, "k_proj": kv_size,
                           "v_proj": kv_size}, bias=cfg.qkv_bias if qkv_bias is None else qkv_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x: Tensor, rotary: Rotary, attn: AttentionBackend) -> Tensor:
        t = x.shape[0]
        q, k, v = self.unpack("qkv_proj", self.qkv_proj(x))
        q = q.reshape(t, self.num_heads, self.head_dim)                 # [T, Hq, D]
        k = k.reshape(t, self.num_kv_heads, self.head_dim)              # [T, Hkv, D]
        v = v.reshape(t, self.num_kv_heads, self.head_dim)              # [T, Hkv, D]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(q, k, rotary)
        out = attn.forward(self.layer_idx, q, k, v)                     # [T, Hq, D]
        return self.o_proj(out.reshape(t, -1))                          # [T, H]


class LlamaMLP(PackedProjections):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up in one GEMM."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        size = cfg.intermediate_size
        self.packed_linear("gate_up_proj", cfg.hidden_size, {"gate_proj": size, "up_proj": size}, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))   # [T, 2I] -> [T, I] -> [T, H]


class LlamaDecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)).

    The residual stream travels as two terms, so each norm adds them in one fused pass: the
    state entering this layer is ``x + residual`` (``x`` alone at the first layer, where
    ``residual`` is None), and the layer returns the same pair for the next one, (MLP output,
    stream before it). The fused norms may overwrite both terms in place.
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, residual: Tensor | None, rotary: Rotary,
                attn: AttentionBackend) -> tuple[Tensor, Tensor]:
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, rotary, attn), residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm (the ``model.`` prefix of HF checkpoints)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM over token-flat batches, for every supported ``cfg.arch``.

    ``forward(input_ids [T], positions [T], attn, taps)`` returns the final normed hidden states
    ``[T, H]`` and, for each index in ``taps``, the hidden state entering that layer ``[T, H]``
    (HF ``hidden_states[i]``; ``i = num_hidden_layers`` is the final normed state).
    ``compute_logits`` applies the LM head.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.embed_tokens

    def tie_weights(self) -> None:
        """Share the embedding matrix with the LM head when the config says so."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionBackend,
                taps: tuple[int, ...] = ()) -> tuple[Tensor, list[Tensor]]:
        num_layers = self.config.num_hidden_layers
        if any(not 0 <= i <= num_layers for i in taps):
            raise ValueError(f"taps {taps} must be layer indices in 0..{num_layers} "
                             f"(this model has {num_layers} layers)")
        h = self.model.embed_tokens(input_ids)                          # [T, H]
        rotary = self.model.rotary_emb(positions, h.dtype)              # cos, sin [T, D]
        tapped: dict[int, Tensor] = {}
        residual = None
        for i, layer in enumerate(self.model.layers):
            if i in taps:  # a new tensor: the fused norms overwrite the stream's terms in place
                tapped[i] = h.clone() if residual is None else h + residual
            h, residual = layer(h, residual, rotary, attn)
        h, _ = self.model.norm(h, residual)
        tapped[num_layers] = h
        return h, [tapped[i] for i in taps]

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """[..., H] -> [..., V]."""
        return self.lm_head(hidden)
