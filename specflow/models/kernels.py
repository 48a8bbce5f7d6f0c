"""RMSNorm, RoPE and SwiGLU's activation for the Llama layers: flashinfer kernels on CUDA, the
torch code elsewhere.

Each function takes flashinfer's kernel (flashinfer-python 0.7.2.post1) when its input is a CUDA
fp16 / bf16 tensor, autograd is off (the kernels have no backward: head training keeps torch) and
flashinfer imports; otherwise the torch code, which equals transformers bit for bit. On the CPU the
dispatch costs one ``is_cuda`` check.

How the fast path differs numerically (both within ~1 bf16 ulp of the torch path):

- ``rms_norm``: ``flashinfer.rmsnorm`` keeps ``x * rsqrt(mean(x^2) + eps) * weight`` in float32 and
  rounds once; transformers rounds the normed x to the model dtype, then multiplies by the weight.
- ``rope``: ``apply_rope_with_cos_sin_cache_inplace`` over a float32 table of this forward's own
  cos/sin rows (row t for token t; built once per forward, ``Rotary.cos_sin_cache``), so every rope scaling (linear, llama3) and arbitrary per-token
  positions (tree depths) come out as in transformers; the rotation is float32, rounded once.
  ``apply_rope_pos_ids`` / ``apply_llama31_rope_pos_ids`` are not used: they compute frequencies and
  angles in the kernel with ``__powf`` / ``__sincosf`` (fast-math, inexact at large angles).
- ``silu_and_mul``: ``flashinfer.silu_and_mul`` over the packed gate|up output computes the SiLU in
  float32 and rounds once; torch rounds silu(gate) before the product.

- ``add_rms_norm``: ``flashinfer.fused_add_rmsnorm`` adds the residual and normalizes in one pass,
  in place: the new residual is the float32 sum rounded to the model dtype (as torch's add), and
  the norm reads the float32 sum before that rounding (torch normalizes the rounded sum). The
  decoder layers keep the residual stream as two terms for it (``LlamaDecoderLayer``), which
  saves an add kernel before every norm.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor

from specflow.models.rope import Rotary, apply_rotary
from specflow.runtime.flashinfer_backend import flashinfer_available

HALF_DTYPES = (torch.float16, torch.bfloat16)  # flashinfer's norm / rope kernels exist for these only


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim of x ``[..., D]`` with weight ``[D]`` (flashinfer on CUDA)."""
    if x.is_cuda and _fast(x) and weight.dtype == x.dtype and x.dim() in (2, 3):
        return _flashinfer().rmsnorm(x, weight, eps)   # [T, D] rows, or [T, H, D] per head
    return torch_rms_norm(x, weight, eps)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Add ``x`` [T, D] to the residual stream and normalize: ``(rms_norm(residual + x), residual + x)``.
    On CUDA in half precision one fused kernel writes both in place, into ``x`` and ``residual``:
    callers must read neither again."""
    if x.is_cuda and _fast(x) and weight.dtype == x.dtype and x.dim() == 2 and x.is_contiguous() \
            and residual.is_contiguous():
        _flashinfer().fused_add_rmsnorm(x, residual, weight, eps)
        return x, residual
    residual = residual + x
    return torch_rms_norm(residual, weight, eps), residual


def torch_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm computed in float32, cast back before the weight (as transformers does)."""
    if x.dtype == torch.float32:  # no casts: one kernel, weight included
        return F.rms_norm(x, x.shape[-1:], weight, eps)
    normed = F.rms_norm(x.float(), x.shape[-1:], eps=eps)  # x * rsqrt(mean(x^2) + eps)
    return weight * normed.to(x.dtype)


def rope(q: Tensor, k: Tensor, rotary: Rotary) -> tuple[Tensor, Tensor]:
    """Rotate q ``[T, Hq, D]`` and k ``[T, Hkv, D]`` by the forward's tables (rotate-half, as
    ``apply_rotary``). May overwrite q and k: use the returned tensors."""
    if q.is_cuda and _fast(q):
        _flashinfer().apply_rope_with_cos_sin_cache_inplace(rotary.rows, q, k, q.shape[-1], rotary.cos_sin_cache)
        return q, k
    return apply_rotary(q, rotary.cos, rotary.sin), apply_rotary(k, rotary.cos, rotary.sin)


def silu_and_mul(x: Tensor) -> Tensor:
    """SwiGLU's activation: ``[..., 2I]`` (gate | up) -> ``silu(gate) * up`` ``[..., I]``."""
    # the kernel's 16-byte loads at gate | up; it reads rows at data_ptr() + r x width, strides unread
    if x.is_cuda and _fast(x) and x.shape[-1] % 16 == 0 and x.is_contiguous():
        return _flashinfer().silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _fast(x: Tensor) -> bool:
    """Whether a CUDA tensor takes the flashinfer path (callers test ``is_cuda`` first)."""
    return x.dtype in HALF_DTYPES and not torch.is_grad_enabled() and flashinfer_available()


@functools.cache
def _flashinfer() -> ModuleType:
    import flashinfer

    return flashinfer
