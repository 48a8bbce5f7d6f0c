"""Load and save Hugging Face checkpoint directories as native Llama-family models.

A directory holds ``config.json`` and weights in the first of: ``model.safetensors``; shards listed
by ``model.safetensors.index.json``; ``pytorch_model.bin``; shards listed by
``pytorch_model.bin.index.json``. The model is built on the meta device (no random init) and
each tensor is assigned once, already in the target dtype and device (q/k/v and gate/up copied
into their rows of one stacked tensor as they arrive), so loading a large model never holds two
copies of it.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from specflow.models.config import CheckpointError, ModelConfig
from specflow.models.llama import LlamaForCausalLM, StackedState, checkpoint_state

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # non-persistent buffers some exporters saved


def load_model(path: str | Path, device: str | torch.device = "cpu",
               dtype: torch.dtype | str = torch.float32) -> LlamaForCausalLM:
    """Load a checkpoint directory; ``dtype`` is a torch dtype, its name, or "auto" (the checkpoint's).

    ``config.eos_token_ids`` also holds the stop tokens of generation_config.json when there is one.
    """
    path = Path(path)
    cfg = load_config(path)
    dtype = resolve_dtype(dtype, read_json(path / "config.json") if dtype == "auto" else {})
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    expected = {k: v.shape for k, v in checkpoint_state(model).items()}  # checkpoint names
    tied_head = None  # a tied checkpoint's own lm_head.weight: it must equal the embedding it is tied to
    if cfg.tie_word_embeddings:
        del expected["lm_head.weight"]
    state, loaded = StackedState(model), set()
    problems, unexpected, refused = [], [], set()
    for name, tensor in _read_tensors(path, device):
        if name.endswith(IGNORED_SUFFIXES):
            continue
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            tied_head = tensor
        elif name not in expected:
            unexpected.append(name)
        elif tensor.shape != expected[name]:
            refused.add(name)
            problems.append(f"{name} has shape {list(tensor.shape)} in the checkpoint but the config "
                            f"expects {list(expected[name])}")
        elif not tensor.is_floating_point():
            refused.add(name)
            problems.append(f"{name} is {str(tensor.dtype).removeprefix('torch.')} in the checkpoint; "
                            f"the model's weights are floating point")
        else:
            state.add(name, tensor.to(device=device, dtype=dtype))
            loaded.add(name)
    if tied_head is not None and "model.embed_tokens.weight" in loaded and not torch.equal(
            tied_head.to(device=device, dtype=dtype), state.state["model.embed_tokens.weight"]):
        problems.append("lm_head.weight differs from model.embed_tokens.weight but config.json says "
                        "tie_word_embeddings: true (set it to false to use the checkpoint's lm_head)")
    missing = sorted(set(expected) - loaded - refused)
    if missing:
        problems.append(f"missing tensors: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {', '.join(sorted(unexpected))}")
    if problems:
        raise CheckpointError(f"checkpoint {path} does not match its config.json ({cfg.arch}): "
                              + "; ".join(problems))
    result = model.load_state_dict(state.state, strict=False, assign=True)
    assert result.missing_keys == (["lm_head.weight"] if cfg.tie_word_embeddings else []), result
    model.tie_weights()
    return model.to(device).eval()


def load_config(path: str | Path) -> ModelConfig:
    """A checkpoint directory's architecture, without its weights: config.json, plus the stop tokens
    of generation_config.json when there is one (``eos_token_ids``)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist; point to a Hugging Face checkpoint directory")
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path} has no config.json; point to a Hugging Face checkpoint directory")
    cfg = ModelConfig.from_hf(read_json(path / "config.json"))
    cfg.eos_token_ids += [t for t in _generation_eos(path) if t not in cfg.eos_token_ids]
    return cfg


def resolve_dtype(dtype: torch.dtype | str, hf: dict) -> torch.dtype:
    """A torch dtype from a dtype, its name, or "auto" (config's ``dtype``/``torch_dtype``, else float32)."""
    if isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
    elif dtype == "auto":
        name = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    else:
        name = dtype
    if name not in DTYPES:
        given = f"dtype 'auto' reads config.json's dtype {name!r}, which" if dtype == "auto" else f"dtype {dtype!r}"
        raise ValueError(f"{given} is not supported; use one of {', '.join(DTYPES)}"
                         + ("" if dtype == "auto" else " or 'auto'"))
    return DTYPES[name]


def _generation_eos(path: Path) -> list[int]:
    """Stop tokens of generation_config.json (chat checkpoints list extra ones there, e.g. Llama 3's
    <|eot_id|>)."""
    file = path / "generation_config.json"
    eos = read_json(file).get("eos_token_id") if file.is_file() else None
    if eos is None:
        return []
    ids = eos if type(eos) is list else [eos]
    if not all(type(t) is int and t >= 0 for t in ids):  # (a string "2" would never match a token: no stop)
        raise CheckpointError(f"{file}: eos_token_id must be a token id or a list of them, got {eos!r}")
    return ids


def _read_tensors(path: Path, device: str | torch.device) -> Iterator[tuple[str, Tensor]]:
    """Yield (name, tensor) from whichever weight layout the directory uses, shard by shard
    (safetensors straight onto ``device``, .bin files memory-mapped on the CPU where their format allows)."""
    for index_name, single in (("model.safetensors.index.json", "model.safetensors"),
                               ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        if (path / single).is_file():  # (before its index, as transformers reads them)
            files = [single]
            break
        index = path / index_name
        if index.is_file():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index} has no weight_map (tensor name -> shard file)")
            files = sorted(set(weight_map.values()))
            break
    else:
        raise CheckpointError(f"{path} has no model.safetensors, model.safetensors.index.json, "
                              f"pytorch_model.bin or pytorch_model.bin.index.json")
    for file in files:
        if not (path / file).is_file():
            raise CheckpointError(f"{path / file} is listed in the weight index but does not exist")
        yield from read_weights(path / file, device)


def read_json(file: Path) -> dict:
    """A checkpoint's JSON file (config.json, a weight index)."""
    try:
        value = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{file} must hold a JSON object ({{\"key\": value, ...}}), "
                              f"not a {type(value).__name__}")
    return value


def read_weights(file: Path, device: str | torch.device) -> Iterator[tuple[str, Tensor]]:
    """Yield (name, tensor) of one weight file: safetensors straight onto ``device``, a .bin
    (torch.save) memory-mapped on the CPU. A file that cannot be read fails naming it."""
    try:
        if file.suffix == ".safetensors":
            with safe_open(file, framework="pt", device=str(device)) as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        else:  # mmap needs torch.save's zip format; the legacy (pre-1.6) format is read into memory
            yield from torch.load(file, map_location="cpu", weights_only=True, mmap=_is_zip(file)).items()
    except torch.OutOfMemoryError:
        raise
    except (SafetensorError, pickle.UnpicklingError, RuntimeError, EOFError, OSError,
            KeyError, IndexError, ValueError) as e:  # (the legacy unpickler's errors on a non-weight file;
        # OSError: torch's zip reader on a .bin cut short within its last 64 KiB, EINVAL)
        raise CheckpointError(f"{file} cannot be read (truncated, or not a weight file?): {e}") from None


def _is_zip(file: Path) -> bool:
    """Whether ``file`` starts as a zip archive (torch.save's format since 1.6; what torch.load checks)."""
    with open(file, "rb") as f:
        return f.read(4) == b"PK\x03\x04"


def save_model(model: LlamaForCausalLM, path: str | Path) -> None:
    """Write ``config.json`` (transformers-compatible) and ``model.safetensors`` to ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    hf = {**model.config.to_hf(), "dtype": dtype, "torch_dtype": dtype}
    (path / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    state = {name: t.detach().to("cpu").contiguous() for name, t in checkpoint_state(model).items()}
    if model.config.tie_word_embeddings:
        del state["lm_head.weight"]
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})


def load_tokenizer(path: str | Path):
    """The checkpoint's tokenizer, or None when the directory has none."""
    path = Path(path)
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:  # (transformers: a tokenizer class without its files, a bad file)
        raise CheckpointError(f"the tokenizer in {path} cannot be loaded: {e}") from None
    if len(tokenizer) <= len(set(tokenizer.all_special_ids)):  # (built from a tokenizer_config.json alone)
        raise CheckpointError(f"the tokenizer in {path} has no vocabulary (only {len(tokenizer)} special "
                              f"token(s)): its vocabulary file (tokenizer.json, tokenizer.model, vocab.json) is "
                              f"missing; copy it beside tokenizer_config.json, or remove the tokenizer files "
                              f"to run on token ids")
    return tokenizer
