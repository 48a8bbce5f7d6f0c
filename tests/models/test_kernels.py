"""kernels.py: on CPU the torch code (equal to transformers bit for bit, flashinfer never called);
on CUDA, flashinfer's RMSNorm (plain and fused with the residual add), RoPE and SiLU-and-mul against float32 references and the torch path."""

import dataclasses

import pytest
import torch
from torch.testing import assert_close
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from specflow.models import LlamaForCausalLM, ModelConfig, kernels
from specflow.models.eagle import EagleHead
from specflow.models.rope import Rotary, RotaryEmbedding, apply_rotary
from specflow.runtime.flashinfer_backend import flashinfer_available
from specflow.runtime.model_runner import ModelRunner

needs_flashinfer = pytest.mark.skipif(not flashinfer_available(), reason="needs CUDA and an importable flashinfer")
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture
def flashinfer_everywhere(monkeypatch):
    """Pretend flashinfer imports, with a module that fails if a kernel is ever asked for."""
    def no_kernels():
        raise AssertionError("flashinfer kernel requested for a CPU tensor")

    monkeypatch.setattr(kernels, "flashinfer_available", lambda: True)
    monkeypatch.setattr(kernels, "_flashinfer", no_kernels)


def tables(positions: torch.Tensor, head_dim: int, dtype: torch.dtype, device="cpu"):
    """llama3-scaled cos/sin [T, D] in ``dtype`` for positions [T]."""
    return RotaryEmbedding(head_dim, 500000.0, LLAMA3).to(device)(positions.to(device), dtype)


# --- CPU: the torch path, exactly as before --------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 48), (7, 3, 16)])
def test_rms_norm_on_cpu_equals_transformers(dtype, shape, flashinfer_everywhere):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g).to(dtype)
    hf = LlamaRMSNorm(shape[-1], eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(1 + torch.randn(shape[-1], generator=g) * 0.1)
    with torch.inference_mode():
        assert torch.equal(kernels.rms_norm(x, hf.weight, 1e-6), hf(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_on_cpu_adds_then_normalizes_as_transformers(dtype, flashinfer_everywhere):
    g = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(2, 7, 48, generator=g) * 3).to(dtype)
    hf = LlamaRMSNorm(48, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(1 + torch.randn(48, generator=g) * 0.1)
    with torch.inference_mode():
        normed, stream = kernels.add_rms_norm(x, residual, hf.weight, 1e-6)
        assert torch.equal(stream, residual + x) and torch.equal(normed, hf(residual + x))


def inplace_add_rms_norm(x, residual, weight, eps):
    """flashinfer.fused_add_rmsnorm's contract on any device: both results written in place."""
    residual.add_(x)
    x.copy_(kernels.torch_rms_norm(residual, weight, eps))
    return x, residual


def test_in_place_fused_norms_leave_outputs_and_taps_unchanged(monkeypatch):
    """The fused kernel overwrites the stream's terms: the forward (taps included, also the
    embedding's) and an EAGLE head (layer 0 without input norm) must read neither again."""
    import specflow.models.llama as llama

    cfg = ModelConfig(arch="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    head = EagleHead(dataclasses.replace(cfg, num_hidden_layers=2), model.embed_tokens, model.lm_head).eval()
    tokens, taps = [[5, 9, 2, 7, 7, 1]], (0, 2, 4)
    features = torch.randn(6, 32)

    def run():
        out = ModelRunner(model, num_pages=32).extend([0], tokens, taps=taps)
        drafted = ModelRunner(head, num_pages=32).extend([0], tokens, logits="none", inputs={"features": features})
        return [out.logits, out.hidden, *out.taps, drafted.hidden]

    expected = run()
    monkeypatch.setattr(llama, "add_rms_norm", inplace_add_rms_norm)
    for got, want in zip(run(), expected):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_on_cpu_equals_transformers(dtype, flashinfer_everywhere):
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 4, 32, generator=g).to(dtype), torch.randn(5, 2, 32, generator=g).to(dtype)
    cos, sin = tables(torch.tensor([0, 3, 3, 4, 9000]), 32, dtype)  # tree nodes share positions
    with torch.inference_mode():
        ours = kernels.rope(q, k, Rotary(cos, sin))
    theirs = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b[0].transpose(0, 1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_on_cpu_equals_transformers_mlp(dtype, flashinfer_everywhere):
    """To rounding, not bitwise: silu over a half of the stacked gate | up (a strided view) may
    round an element differently from silu over a contiguous gate (1 ulp in 4 of 672 float32
    elements on an AVX-512 CPU, none on AVX2)."""
    g = torch.Generator().manual_seed(0)
    gate, up = torch.randn(2, 7, 48, generator=g).to(dtype)
    with torch.inference_mode():
        torch.testing.assert_close(kernels.silu_and_mul(torch.cat([gate, up], -1)),
                                   torch.nn.functional.silu(gate) * up)


def test_fast_path_needs_half_precision_no_autograd_and_flashinfer(monkeypatch):
    bf16, fp32 = torch.ones(2, dtype=torch.bfloat16), torch.ones(2)
    monkeypatch.setattr(kernels, "flashinfer_available", lambda: True)
    with torch.inference_mode():
        assert kernels._fast(bf16) and kernels._fast(bf16.half())
        assert not kernels._fast(fp32)
    assert not kernels._fast(bf16)  # autograd on: head training keeps the differentiable torch code
    monkeypatch.setattr(kernels, "flashinfer_available", lambda: False)
    with torch.inference_mode():
        assert not kernels._fast(bf16)


# --- CUDA: flashinfer against float32 references and the torch path ---------------------------

def spy(monkeypatch, name: str) -> list:
    """Count calls of flashinfer.<name>."""
    import flashinfer

    calls, fn = [], getattr(flashinfer, name)
    monkeypatch.setattr(flashinfer, name, lambda *a, **kw: calls.append(1) or fn(*a, **kw))
    return calls


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(37, 4096), (37, 8, 128), (5, 2, 64)])  # hidden rows; Qwen3 q/k heads
def test_flashinfer_rms_norm(dtype, shape, monkeypatch):
    calls = spy(monkeypatch, "rmsnorm")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(shape, generator=g, device="cuda") * 3).to(dtype)
    w = (1 + torch.randn(shape[-1], generator=g, device="cuda") * 0.1).to(dtype)
    with torch.inference_mode():
        fast = kernels.rms_norm(x, w, 1e-6)
    assert calls and fast.dtype == dtype and fast.shape == x.shape
    exact = torch.nn.functional.rms_norm(x.float(), shape[-1:], w.float(), 1e-6)
    eps = torch.finfo(dtype).eps
    assert_close(fast.float(), exact, rtol=eps, atol=1e-5)  # one rounding: within half an ulp
    assert_close(fast, kernels.torch_rms_norm(x, w, 1e-6), rtol=2 * eps, atol=1e-5)


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flashinfer_add_rms_norm(dtype, monkeypatch):
    calls = spy(monkeypatch, "fused_add_rmsnorm")
    g = torch.Generator(device="cuda").manual_seed(0)
    x, residual = (torch.randn(2, 37, 4096, generator=g, device="cuda") * 3).to(dtype)
    w = (1 + torch.randn(4096, generator=g, device="cuda") * 0.1).to(dtype)
    stream = residual + x  # torch rounds the sum once, as the kernel does for the new residual
    with torch.inference_mode():
        normed, fused_stream = kernels.add_rms_norm(x.clone(), residual.clone(), w, 1e-6)
    assert calls and torch.equal(fused_stream, stream)
    # the kernel normalizes the float32 sum, before its rounding: one rounding at the end
    exact = torch.nn.functional.rms_norm(residual.float() + x.float(), (4096,), w.float(), 1e-6)
    eps = torch.finfo(dtype).eps
    assert_close(normed.float(), exact, rtol=2 * eps, atol=1e-5)
    assert_close(normed, kernels.torch_rms_norm(stream, w, 1e-6), rtol=2 * eps, atol=1e-5)


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_flashinfer_rope(dtype, head_dim, monkeypatch):
    calls = spy(monkeypatch, "apply_rope_with_cos_sin_cache_inplace")
    g = torch.Generator(device="cuda").manual_seed(head_dim)
    t = 300
    positions = torch.randint(0, 100_000, (t,), generator=g, device="cuda")
    positions[1::3] = positions[::3][: len(positions[1::3])]  # tree siblings share a position
    q = torch.randn(t, 8, head_dim, generator=g, device="cuda").to(dtype)
    k = torch.randn(t, 2, head_dim, generator=g, device="cuda").to(dtype)
    cos, sin = tables(positions, head_dim, dtype, "cuda")
    exact = [apply_rotary(x.float(), cos.float(), sin.float()) for x in (q, k)]  # same rounded tables
    reference = [apply_rotary(x, cos, sin) for x in (q, k)]
    with torch.inference_mode():
        fast = kernels.rope(q.clone(), k.clone(), Rotary(cos, sin))
    assert calls
    eps = torch.finfo(dtype).eps
    for f, e, r in zip(fast, exact, reference):
        assert_close(f.float(), e, rtol=eps, atol=1e-4)  # float32 rotation, one rounding
        assert_close(f, r, rtol=4 * eps, atol=8 * eps)  # torch rounds each product and the sum


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flashinfer_silu_and_mul(dtype, monkeypatch):
    calls = spy(monkeypatch, "silu_and_mul")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(37, 2 * 1792, generator=g, device="cuda") * 3).to(dtype)  # gate | up
    with torch.inference_mode():
        fast = kernels.silu_and_mul(x)
    gate, up = x.float().chunk(2, -1)
    assert calls and fast.shape == (37, 1792)
    eps = torch.finfo(dtype).eps
    assert_close(fast.float(), torch.nn.functional.silu(gate) * up, rtol=2 * eps, atol=1e-5)  # float32, rounded once


@pytest.mark.gpu
@needs_flashinfer
def test_model_with_flashinfer_kernels_is_closer_to_float32_than_torch_bf16(monkeypatch):
    cfg = ModelConfig(arch="qwen3", vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, qk_norm=True,
                      rope_theta=500000.0, rope_scaling=LLAMA3)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    prompts = [torch.randint(0, 512, (n,)).tolist() for n in (40, 7, 23)]

    def hidden(m, use_flashinfer: bool) -> torch.Tensor:
        monkeypatch.setattr(kernels, "flashinfer_available", lambda: use_flashinfer)
        runner = ModelRunner(m, num_pages=128, page_size=16, backend="torch")
        return runner.extend([0, 1, 2], prompts, logits="none").hidden.float()

    calls = spy(monkeypatch, "apply_rope_with_cos_sin_cache_inplace")
    exact = hidden(model.cuda(), use_flashinfer=False)
    model = model.to(torch.bfloat16)
    fast, reference = hidden(model, use_flashinfer=True), hidden(model, use_flashinfer=False)
    assert len(calls) == cfg.num_hidden_layers
    err_fast, err_reference = (fast - exact).abs().mean(), (reference - exact).abs().mean()
    assert err_fast < 1.5 * err_reference, (err_fast, err_reference)
