"""Checkpoint I/O shared by the draft heads (EAGLE, EAGLE-3, Medusa).

A head directory holds ``config.json`` and its weights in one file: ``model.safetensors`` or
``pytorch_model.bin`` (read with ``torch.load(weights_only=True)``), or a name of the head's
own tradition (Medusa's ``medusa_lm_head.{safetensors,pt}``). A head is built on the meta
device, every tensor of the file is checked against the shape the head needs (a mismatch names
the tensor and both shapes), then assigned once in the target dtype and device.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from specflow.models.config import CheckpointError
from specflow.models.loader import read_json, read_weights
from specflow.models.llama import StackedState, checkpoint_state

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
Format = Literal["safetensors", "bin"]


def read_head(path: str | Path, weight_files: tuple[str, ...] = WEIGHT_FILES) -> tuple[dict, dict[str, Tensor]]:
    """(config.json as a dict, state dict on the CPU) of a head directory."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path} has no config.json; point to a draft head checkpoint directory")
    hf = read_json(config_file)
    for name in weight_files:
        if (path / name).is_file():
            return hf, dict(read_weights(path / name, "cpu"))
    raise CheckpointError(f"{path} has none of the weight files {', '.join(weight_files)}")


def assign_state(head: nn.Module, state: dict[str, Tensor], path: str | Path, *, optional: tuple[str, ...] = (),
                 ignore: dict[str, tuple[int, ...]] | None = None, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32) -> list[str]:
    """Load ``state`` into ``head`` (built on the meta device) with ``assign=True``.

    Every tensor must match the head's shape for it; ``optional`` names may be absent (returned,
    for the caller to fill); ``ignore`` maps names the file may carry but the head does not use
    (e.g. a copy of the target's embedding) to the shape they must have.
    """
    state_meta = checkpoint_state(head)                                       # checkpoint names
    expected = {k: tuple(v.shape) for k, v in state_meta.items()}
    dtypes = {k: v.dtype for k, v in state_meta.items()}
    floating = {k: v.is_floating_point() for k, v in state_meta.items()}
    ignore = ignore or {}
    loaded, problems, unexpected = StackedState(head), [], []
    names = set()
    for name, tensor in state.items():
        want = expected.get(name, ignore.get(name))
        if want is None:
            unexpected.append(name)
        elif tuple(tensor.shape) != want:
            problems.append(f"{name} has shape {list(tensor.shape)} in the checkpoint but the head needs "
                            f"{list(want)}")
        elif name in expected and floating[name] and not tensor.is_floating_point():
            problems.append(f"{name} is {str(tensor.dtype).removeprefix('torch.')} in the checkpoint; "
                            f"the head's weights are floating point")
        elif name in expected and not floating[name] and tensor.is_floating_point():  # (d2t, t2d: token ids)
            problems.append(f"{name} is {str(tensor.dtype).removeprefix('torch.')} in the checkpoint but the "
                            f"head needs {str(dtypes[name]).removeprefix('torch.')} (token ids, not weights)")
        elif name in expected:
            loaded.add(name, tensor.to(device=device, dtype=dtype if floating[name] else dtypes[name]))
            names.add(name)
    missing = sorted(set(expected) - set(state) - set(optional))
    if missing:
        problems.append(f"missing tensors: {', '.join(missing)}")
    if unexpected:
        hint = (" (q/k/v biases: an EAGLE head that has them says \"qkv_bias\": true in its config.json)"
                if any(n.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")) for n in unexpected) else "")
        problems.append(f"unexpected tensors: {', '.join(sorted(unexpected))}{hint}")
    if problems:
        raise CheckpointError(f"head checkpoint {path} does not fit (config.json + target): " + "; ".join(problems))
    head.load_state_dict(loaded.state, strict=False, assign=True)
    return sorted(set(expected) - names)


def check_fits(what: str, head_value: int, target_value: int, path: str | Path) -> None:
    """Raise CheckpointError when a head's size (hidden size, vocabulary) differs from its target's."""
    if head_value != target_value:
        raise CheckpointError(f"head {path}: {what} is {head_value} but the target's is {target_value}; "
                              f"this head was trained for another target model")


def write_head(path: str | Path, hf: dict, state: dict[str, Tensor], *, format: Format = "safetensors",
               file_names: tuple[str, str] = WEIGHT_FILES) -> Path:
    """Write ``config.json`` and the weights (``file_names`` = (safetensors name, torch name))."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    state = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    if format == "safetensors":
        save_file(state, path / file_names[0], metadata={"format": "pt"})
    elif format == "bin":
        torch.save(state, path / file_names[1])
    else:
        raise ValueError(f"format must be 'safetensors' or 'bin', got {format!r}")
    return path
