"""EAGLE-3 draft head in the public layout of SafeAILab/EAGLE (``cnets.py``), as SGLang's
``LlamaForCausalLMEagle3`` loads it.

config.json is a Llama config with ``num_hidden_layers: 1`` plus ``draft_vocab_size`` (default:
vocab_size), optional ``target_hidden_size`` and ``bias`` (fc bias, default false). Keys::

    fc.weight [H, 3H]                         over the concatenated target taps
    midlayer.self_attn.{q,k,v}_proj.weight    [heads * head_dim, 2H]; o_proj [H, heads * head_dim]
    midlayer.mlp.{gate,up,down}_proj.weight
    midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight
    norm.weight, lm_head.weight [draft_vocab, H]
    d2t int64 [draft_vocab]: target_id = draft_id + d2t[draft_id];  t2d bool [vocab]

The embedding is the target's (``embed_tokens.weight`` in the file is ignored).

Layer: ``h' = h + attn(cat(input_layernorm(embed), hidden_norm(h)))``, then the MLP block;
the logits are ``lm_head(norm(h'))`` and ``h'`` (before the norm) is the next feature.

Alignment as EAGLE-1 (cnets.py ``topK_genrate``): token x_{j+1} is paired with the target
feature of x_j at rotary position j; the target feature is ``fc(cat(taps))`` of x_j.

Taps (the hidden states entering target layers, ``TargetNeeds.layer_taps``): SGLang's default
``[2, L // 2, L - 3]``; a config ``eagle_config.eagle_aux_hidden_state_layer_ids`` (SGLang,
ids of layer *outputs*: tap = id + 1) or a top-level ``eagle_aux_hidden_state_layer_ids``
(vLLM, ids of layer *inputs*: tap = id) overrides it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from specflow.models.config import CheckpointError, ModelConfig
from specflow.models.eagle import head_attention, head_config
from specflow.models.head_io import Format, assign_state, check_fits, read_head, write_head
from specflow.models.llama import LlamaForCausalLM, LlamaMLP, RMSNorm, checkpoint_state
from specflow.models.rope import Rotary, RotaryEmbedding

if TYPE_CHECKING:
    from specflow.runtime.attention import AttentionBackend


def eagle3_taps(hf: dict, num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose input hidden states the head reads, from its config.json."""
    n = num_target_layers
    sglang_ids = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    vllm_ids = hf.get("eagle_aux_hidden_state_layer_ids")
    if sglang_ids:
        taps, source = [i + 1 for i in sglang_ids], "eagle_config.eagle_aux_hidden_state_layer_ids (+1)"
    elif vllm_ids:
        taps, source = list(vllm_ids), "eagle_aux_hidden_state_layer_ids"
    else:
        taps, source = [2, n // 2, n - 3], "the default [2, L // 2, L - 3]"
    if any(not 0 <= t < n for t in taps):
        raise CheckpointError(f"EAGLE-3 taps {taps} from {source} are not layer inputs of a {n}-layer "
                              f"target (0..{n - 1}); set eagle_config.eagle_aux_hidden_state_layer_ids "
                              f"in the head's config.json")
    return tuple(taps)


class Eagle3Layer(nn.Module):
    """The ``midlayer``: attention over cat(input_layernorm(embed), hidden_norm(h)), residual h."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h = cfg.hidden_size
        self.self_attn = head_attention(cfg, 0, 2 * h)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)

    def forward(self, embeds: Tensor, hidden: Tensor, rotary: Rotary, attn: AttentionBackend) -> Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], -1)  # [T, 2H]
        h = hidden + self.self_attn(x, rotary, attn)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(nn.Module):
    """EAGLE-3 head over a target's embedding (see module docstring).

    ``forward(input_ids [T], positions [T], attn, taps=(), *, features)`` takes target taps
    ``[T, len(taps) * H]`` (projected by ``fc``) or features already projected (``project``) / fed
    back ``[T, H]``, and returns the head's output ``[T, H]``; one tap's taps are ``[T, H]`` too and
    must go through ``project`` first (training and the drafter always do). ``compute_logits``
    gives draft-vocab logits; ``draft_to_target`` maps draft ids to target ids through ``d2t``.
    """

    def __init__(self, cfg: ModelConfig, embed_tokens: nn.Embedding, taps: tuple[int, ...], *,
                 draft_vocab_size: int | None = None, bias: bool = False):
        super().__init__()
        h = cfg.hidden_size
        self.config, self.taps, self.bias = cfg, tuple(taps), bias
        self.target_modules = (embed_tokens,)  # a tuple: not registered as a submodule
        self.fc = nn.Linear(len(self.taps) * h, h, bias=bias)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.draft_vocab_size = draft_vocab_size or cfg.vocab_size
        self.lm_head = nn.Linear(h, self.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

    def project(self, features: Tensor) -> Tensor:
        """Concatenated target taps [T, len(taps) * H] -> the head's feature [T, H] (``fc``), for
        any number of taps: with one tap the taps are [T, H] too, so the width cannot tell them
        from a projected feature, and ``fc`` must still apply (as training applies it)."""
        return self.fc(features)

    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionBackend,
                taps: tuple[int, ...] = (), *, features: Tensor) -> tuple[Tensor, list[Tensor]]:
        assert not taps, "a draft head has no layer taps"
        embeds = self.target_modules[0](input_ids)                   # [T, H]
        features = features.to(embeds.dtype)
        # as cnets.py / SGLang: a width other than H is target taps (fc); an [T, H] input is a
        # projected or fed-back feature (a one-tap head's taps must come through ``project``)
        hidden = features if features.shape[-1] == self.config.hidden_size else self.fc(features)
        return self.midlayer(embeds, hidden, self.rotary_emb(positions, hidden.dtype), attn), []

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """[..., H] -> [..., draft vocab]."""
        return self.lm_head(self.norm(hidden))

    def draft_to_target(self, ids: Tensor) -> Tensor:
        """Draft token ids -> target token ids (``d2t`` holds offsets)."""
        return ids + self.d2t[ids]


def load_eagle3(path: str | Path, target_model: LlamaForCausalLM, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32) -> Eagle3Head:
    """Load an EAGLE-3 head directory for ``target_model``; CheckpointError when it does not fit."""
    hf, state = read_head(path)
    cfg = head_config(hf)
    target = target_model.config
    if cfg.num_hidden_layers != 1:
        raise CheckpointError(f"head {path}: num_hidden_layers is {cfg.num_hidden_layers}; the EAGLE-3 "
                              f"layout has one layer (midlayer)")
    check_fits("hidden_size", cfg.hidden_size, target.hidden_size, path)
    check_fits("target_hidden_size", hf.get("target_hidden_size") or cfg.hidden_size, target.hidden_size, path)
    check_fits("vocab_size", cfg.vocab_size, target.vocab_size, path)
    draft_vocab = hf.get("draft_vocab_size") or cfg.vocab_size
    with torch.device("meta"):
        head = Eagle3Head(cfg, target_model.embed_tokens, eagle3_taps(hf, target.num_hidden_layers),
                          draft_vocab_size=draft_vocab, bias=hf.get("bias", False))
    same_vocab = draft_vocab == cfg.vocab_size
    missing = assign_state(head, state, path, optional=("d2t", "t2d") if same_vocab else ("t2d",),
                           ignore={"embed_tokens.weight": (target.vocab_size, target.hidden_size)},
                           device=device, dtype=dtype)
    if "d2t" in missing:  # same vocabulary: the identity map
        head.d2t = torch.zeros(draft_vocab, dtype=torch.long, device=device)
    target_ids = torch.arange(draft_vocab, device=device) + head.d2t
    if not bool(((target_ids >= 0) & (target_ids < cfg.vocab_size)).all()):
        raise CheckpointError(f"head {path}: d2t maps draft ids outside the target vocabulary "
                              f"(0..{cfg.vocab_size - 1}); d2t must hold offsets target_id - draft_id")
    if "t2d" in missing:
        head.t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool, device=device).index_fill_(0, target_ids, True)
    return head.to(device).eval()


def save_eagle3(head: Eagle3Head, path: str | Path, format: Format = "safetensors") -> Path:
    """Write the head as SafeAILab/EAGLE publishes it (config.json + weights, with d2t and t2d)."""
    dtype = str(next(head.parameters()).dtype).removeprefix("torch.")
    hf = {**head.config.to_hf(), "architectures": ["LlamaForCausalLMEagle3"],
          "draft_vocab_size": head.draft_vocab_size, "torch_dtype": dtype}
    if head.bias:
        hf["bias"] = True
    hf["eagle_aux_hidden_state_layer_ids"] = list(head.taps)  # vLLM's key: ids of the layers whose inputs are tapped
    if min(head.taps) >= 1:  # SGLang's: ids of the layers whose outputs are (none for the embedding output)
        hf["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [t - 1 for t in head.taps],
                              "use_aux_hidden_state": True}
    return write_head(path, hf, checkpoint_state(head), format=format)
