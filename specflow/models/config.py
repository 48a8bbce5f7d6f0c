"""ModelConfig: the architecture of a Llama-family model, read from a Hugging Face config.json.

One dataclass covers Llama 2/3, Mistral, Qwen2 and Qwen3; the differences are flags:

| arch    | bias                       | q/k norm | attention                    |
|---------|----------------------------|----------|------------------------------|
| llama   | attention_bias, mlp_bias   | no       | causal                       |
| mistral | none                       | no       | causal, global sliding_window|
| qwen2   | q/k/v always (o_proj none) | no       | causal                       |
| qwen3   | attention_bias             | yes      | causal                       |
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specflow.models.rope import check_rope_scaling


class CheckpointError(ValueError):
    """A checkpoint directory (config.json or weights) that cannot be loaded as it is."""


ARCHS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
         "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# transformers' defaults for keys a config.json may omit, where the architectures differ
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048, "num_key_value_heads": None, "head_dim": None},
    "mistral": {"max_position_embeddings": 4096 * 32, "num_key_value_heads": 8, "head_dim": None,
                "sliding_window": 4096},
    "qwen2": {"max_position_embeddings": 32768, "num_key_value_heads": 32, "head_dim": None},
    "qwen3": {"max_position_embeddings": 32768, "num_key_value_heads": 32, "head_dim": 128},
}


@dataclass
class ModelConfig:
    """Architecture hyperparameters of a native Llama-family model.

    ``rope_scaling`` is ``None`` for plain RoPE or ``{"rope_type": ..., **parameters}`` (without
    ``rope_theta``, which has its own field). ``num_key_value_heads`` and ``head_dim`` default to
    ``num_attention_heads`` and ``hidden_size // num_attention_heads``.
    """

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise CheckpointError(f"unsupported architecture {self.arch!r}; supported: {', '.join(ARCHS)}")
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple "
                                  f"of num_key_value_heads ({self.num_key_value_heads})")
        if self.rope_scaling is not None:
            self.rope_scaling = dict(self.rope_scaling)
            if self.rope_scaling.get("rope_type") == "llama3":
                self.rope_scaling.setdefault("original_max_position_embeddings", self.max_position_embeddings)
        check_rope_scaling(self.rope_scaling)

    @property
    def qkv_bias(self) -> bool:
        """Whether q/k/v projections carry a bias (Qwen2 always; others via attention_bias)."""
        return self.attention_bias or self.arch == "qwen2"

    @classmethod
    def from_hf(cls, hf: dict) -> ModelConfig:
        """Read a transformers config dict: 4.x style (``rope_theta`` + ``rope_scaling``) or 5.x
        style (``rope_parameters`` holding both)."""
        arch = _arch(hf)
        defaults = _HF_DEFAULTS[arch]

        def get(key: str) -> Any:
            return hf[key] if key in hf else defaults.get(key)

        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in hf]
        if missing:
            raise CheckpointError(f"config.json lacks {', '.join(missing)}")
        _check_types(hf)
        quantization = hf.get("quantization_config")
        if quantization:  # (its weights need dequantising: scales, packed ints; read as they are they are wrong)
            method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else quantization
            raise NotImplementedError(f"quantized checkpoints are not supported (config.json quantization_config: "
                                      f"quant_method {method!r}); use the model's unquantized checkpoint")
        if hf.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act {hf['hidden_act']!r} is not implemented; "
                                      f"Llama-family models use 'silu'")
        if arch in ("qwen2", "qwen3"):
            _reject_sliding_layers(hf)
        rope_theta, rope_scaling = _rope(hf)
        eos = hf.get("eos_token_id")
        return cls(
            arch=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=hf["num_attention_heads"],
            num_key_value_heads=get("num_key_value_heads"),
            head_dim=get("head_dim"),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=get("max_position_embeddings"),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=arch in ("llama", "qwen3") and hf.get("attention_bias", False),
            mlp_bias=arch == "llama" and hf.get("mlp_bias", False),
            qk_norm=arch == "qwen3",
            sliding_window=get("sliding_window") if arch == "mistral" else None,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=[] if eos is None else [eos] if isinstance(eos, int) else list(eos),
        )

    def to_hf(self) -> dict:
        """A config.json dict that transformers (4.45+ and 5.x) loads as the same architecture."""
        eos = self.eos_token_ids
        hf: dict[str, Any] = {
            "architectures": [ARCHS[self.arch]],
            "model_type": self.arch,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,  # a copy: HF edits it
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        }
        if self.arch in ("llama", "qwen3"):
            hf["attention_bias"] = self.attention_bias
        if self.arch == "llama":
            hf["mlp_bias"] = self.mlp_bias
        if self.arch == "mistral":
            hf["sliding_window"] = self.sliding_window
        if self.arch in ("qwen2", "qwen3"):
            hf["use_sliding_window"] = False
        return hf


def _token_id(v: Any) -> bool:
    return type(v) is int and v >= 0


_TYPES = {  # config.json key -> (what it must be, test); null passes (the key's default)
    **dict.fromkeys(("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window"),
                    ("a positive integer", lambda v: type(v) is int and v > 0)),
    **dict.fromkeys(("rms_norm_eps", "rope_theta"), ("a positive number", lambda v: type(v) in (int, float) and v > 0)),
    **dict.fromkeys(("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window"),
                    ("true or false", lambda v: type(v) is bool)),
    "bos_token_id": ("a token id", _token_id),
    "eos_token_id": ("a token id or a list of them", lambda v: all(map(_token_id, v if type(v) is list else [v]))),
}


def _check_types(hf: dict) -> None:
    """Fail naming the first config.json key whose value has the wrong type (a string "64", 1e-5 as "1e-5")."""
    for key, (kind, ok) in _TYPES.items():
        if hf.get(key) is not None and not ok(hf[key]):
            raise CheckpointError(f"config.json: {key} must be {kind}, got {hf[key]!r}")


def _arch(hf: dict) -> str:
    """The architecture from ``model_type``, else from ``architectures``."""
    model_type = hf.get("model_type")
    if model_type is None:
        by_class = {cls_name: arch for arch, cls_name in ARCHS.items()}
        names = hf.get("architectures") or []
        model_type = next((by_class[n] for n in names if n in by_class), names[0] if names else None)
    if model_type not in ARCHS:
        raise CheckpointError(f"model_type {model_type!r} is not supported; supported model types: "
                              f"{', '.join(ARCHS)}")
    return model_type


def _reject_sliding_layers(hf: dict) -> None:
    """Qwen2/Qwen3 switch some layers to sliding-window attention; the runtime has one global window."""
    layer_types = hf.get("layer_types")
    if layer_types is None and hf.get("use_sliding_window", False):
        first = hf.get("max_window_layers", 28)
        layer_types = ["sliding_attention" if i >= first else "full_attention"
                       for i in range(hf["num_hidden_layers"])]
    if layer_types and "sliding_attention" in layer_types:
        raise NotImplementedError(
            "per-layer sliding-window attention (use_sliding_window: true with max_window_layers < "
            "num_hidden_layers) is not implemented for Qwen2/Qwen3; use a checkpoint with "
            "use_sliding_window: false")


def _rope(hf: dict) -> tuple[float, dict | None]:
    """(rope_theta, normalised rope_scaling) from either config generation.

    As transformers 5 reads them: a non-empty ``rope_scaling`` (4.x, or added by hand to a 5.x
    config, as model cards say for long context) replaces ``rope_parameters`` whole, theta included
    (then read from ``rope_theta``)."""
    scaling = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    if any(isinstance(v, dict) for v in scaling.values()):
        raise NotImplementedError("per-layer-type rope_parameters are not implemented for "
                                  "Llama-family models")
    rope_theta = float(scaling.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rope_type == "default":
        return rope_theta, None
    return rope_theta, {"rope_type": rope_type, **scaling}
