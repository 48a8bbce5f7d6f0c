"""Shared pieces of the GPU benchmarks in ``bench/gpu/``: Llama-3.1-8B-shaped models with random
weights made on the device, timers, the common command line and the JSON they write.

Every script runs at the real shape by default (an H200, bfloat16) and at a tiny shape with
``--tiny`` (a CPU smoke run in seconds); both write the same JSON keys.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from specflow.bench.decode import best_times
from specflow.bench.provenance import git_commit, git_dirty
from specflow.engine import SpecEngine
from specflow.models import LlamaForCausalLM, ModelConfig
from specflow.models.llama import checkpoint_state
from specflow.pipeline import resolve_device
from specflow.sampling import SamplingParams

# meta-llama/Llama-3.1-8B-Instruct's config.json, as a ModelConfig
LLAMA_8B = dict(
    arch="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
    max_position_embeddings=131072, bos_token_id=128000, eos_token_ids=[128001, 128008, 128009])
# the same architecture (GQA, llama3 RoPE) small enough for a CPU smoke run
TINY = dict(LLAMA_8B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, bos_token_id=1, eos_token_ids=[2])
INIT_STD = 0.02  # Llama's initializer_range: logits of a random model stay O(1)


def llama_config(tiny: bool) -> ModelConfig:
    return ModelConfig(**(TINY if tiny else LLAMA_8B))


def shape_of(cfg: ModelConfig) -> dict:
    """The JSON record of a model's architecture."""
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "rope_scaling")
    return {k: getattr(cfg, k) for k in keys}


def random_init_(module: nn.Module, device: torch.device, dtype: torch.dtype, seed: int = 0) -> nn.Module:
    """Give a module built on the meta device random weights made on ``device`` in ``dtype``
    (norm weights 1, biases 0, the rest N(0, INIT_STD)), one tensor at a time: an 8B model
    never exists twice, nor on the host. Buffers (RoPE tables) move to ``device`` as they are."""
    gen = torch.Generator(device).manual_seed(seed)
    state = {}
    for name, p in module.named_parameters():
        if name.endswith("norm.weight"):
            state[name] = torch.ones(p.shape, device=device, dtype=dtype)
        elif name.endswith("bias"):
            state[name] = torch.zeros(p.shape, device=device, dtype=dtype)
        else:
            state[name] = torch.randn(p.shape, generator=gen, device=device, dtype=dtype).mul_(INIT_STD)
    module.load_state_dict(state, strict=True, assign=True)
    return module.to(device).eval()


def random_llama(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int = 0) -> LlamaForCausalLM:
    """A native Llama with random weights, built directly on ``device``."""
    assert not cfg.tie_word_embeddings, "random_init_ would give the tied pair two tensors"
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    return random_init_(model, device, dtype, seed)


def hf_llama(model: LlamaForCausalLM):
    """A ``transformers`` LlamaForCausalLM sharing ``model``'s weight tensors (no copy: q/k/v and
    gate/up are views of the stacked tensors)."""
    import transformers

    param = next(model.parameters())
    config = transformers.LlamaConfig.from_dict(model.config.to_hf())
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(config)
    hf.load_state_dict(checkpoint_state(model, copy=False), strict=True, assign=True)  # views: no copy
    # RoPE tables are non-persistent buffers: build them again off the meta device
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config=hf.config).to(param.device)
    left = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
    assert not left, f"tensors left on the meta device: {left}"
    return hf.eval()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], object], device: torch.device, iters: int, warmup: int) -> float:
    """Median milliseconds of ``fn`` over ``iters`` calls after ``warmup``: CUDA events on a GPU
    (the queue drained before each call, so host overhead counts), perf_counter on the CPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        synchronize(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def step_ms(engine: SpecEngine, prompt: list[int], iters: int, warmup: int, device: torch.device,
            max_tokens_per_step: int = 1) -> tuple[float, float]:
    """(median ms of ``engine.step()`` on one running request, its mean tokens per step). Each
    step starts on an idle GPU and ends when the work it queued has run: for plain decoding,
    which lands the last step's tokens while its own forward runs, the launch, that forward
    and whatever of the landing outlasts it."""
    params = SamplingParams(temperature=0.0, max_tokens=(iters + warmup + 4) * max_tokens_per_step, ignore_eos=True)
    rid = engine.add_request(prompt, params)
    engine.step()  # prefill (+ the first step)
    ms = median_ms(engine.step, device, iters, warmup)
    out = engine.snapshot([rid])
    engine.abort(rid)
    # (plain decoding lands a step's tokens in the next step)
    assert len(out[0].accept_lengths) >= iters + warmup, "the request did not run every step (KV pool too small?)"
    return ms, tokens_per_step(out)


def steady_step_ms(engine: SpecEngine, prompt: list[int], iters: int, warmup: int, device: torch.device,
                   max_tokens_per_step: int = 1) -> float:
    """Mean milliseconds of ``engine.step()`` on one running request over ``iters`` steps run back
    to back (after ``warmup``), the device drained before and after the block only: a step's cost
    inside a running generation, where plain decoding launches each forward while the last one
    runs and so hides its host work (``step_ms`` starts every step on an idle GPU, which adds that
    host work to a decode step; a speculative step, which reads its verdict, hides little)."""
    params = SamplingParams(temperature=0.0, max_tokens=(iters + warmup + 4) * max_tokens_per_step, ignore_eos=True)
    rid = engine.add_request(prompt, params)
    for _ in range(1 + warmup):  # prefill (+ the first step), then warm-up steps
        engine.step()
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        engine.step()
    synchronize(device)
    ms = (time.perf_counter() - t0) * 1e3 / iters
    out = engine.snapshot([rid])
    engine.abort(rid)
    assert len(out[0].accept_lengths) >= iters + warmup, "the request did not run every step (KV pool too small?)"
    return ms


def profile_steps(engine: SpecEngine, prompt: list[int], device: torch.device, path: Path, steps: int = 5,
                  max_tokens_per_step: int = 1) -> None:
    """torch.profiler over ``steps`` engine steps of one running request (after two warm-up steps):
    where host and device time go, by self CPU and by device time, written to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(temperature=0.0, max_tokens=(steps + 4) * max_tokens_per_step, ignore_eos=True)
    rid = engine.add_request(prompt, params)
    for _ in range(3):  # prefill, then warm-up steps (graph capture)
        engine.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        synchronize(device)
    engine.abort(rid)
    path.parent.mkdir(parents=True, exist_ok=True)  # (profiles are written before the JSON result)
    table = prof.key_averages()
    sections = [("self CPU time", "self_cpu_time_total")]
    if device.type == "cuda":
        sections.append(("device time", "self_device_time_total"))
    path.write_text("".join(f"== {steps} engine steps, by {title}\n{table.table(sort_by=key, row_limit=40)}\n"
                            for title, key in sections))
    print(f"wrote {path}")


def sync_points(engine: SpecEngine, prompt: list[int], device: torch.device, steps: int = 5,
                max_tokens_per_step: int = 1, temperature: float = 0.0) -> dict | None:
    """Where ``engine.step()`` makes the host wait for the GPU (CUDA's sync debug mode, which
    flags blocking copies, ``.item()``, ``.tolist()`` and the like) over ``steps`` steps of one
    running request (sampled at ``temperature``) after warm-up: ``per_step`` and the count per
    calling ``file:line``. None off CUDA."""
    if device.type != "cuda":
        return None
    params = SamplingParams(temperature=temperature, max_tokens=(steps + 4) * max_tokens_per_step,
                            ignore_eos=True, seed=0)
    rid = engine.add_request(prompt, params)
    for _ in range(3):  # prefill, then warm-up steps (graph capture)
        engine.step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    engine.abort(rid)
    sites = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))
    return {"per_step": sum(sites.values()) / steps, "sites": dict(sites.most_common())}


def tokens_per_step(outs) -> float:
    """Mean tokens committed per step over request outputs."""
    steps = sum(len(o.accept_lengths) for o in outs)
    return sum(sum(o.accept_lengths) for o in outs) / max(1, steps)


def best_seconds(fns: list[Callable[[], object]], device: torch.device, repeats: int) -> list[float]:
    """Best-of-``repeats`` seconds of each function, alternating (specflow.bench.decode), each
    call ending with a device synchronize."""

    def synced(fn):
        def call():
            fn()
            synchronize(device)
        return call

    return best_times([synced(fn) for fn in fns], repeats)


def parser(doc: str) -> argparse.ArgumentParser:
    """The options every GPU benchmark takes."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON file to write (e.g. bench/results/NAME.json)")
    p.add_argument("--tiny", action="store_true", help="a tiny Llama and short runs: a CPU smoke test")
    p.add_argument("--backend", default="auto", help="attention backend of the engine (auto: flashinfer on CUDA when installed)")
    p.add_argument("--profile", action="store_true",
                   help="also write a torch.profiler table of a few engine steps next to --out (NAME.profile.txt)")
    p.add_argument("--cuda-graphs", choices=["auto", "on", "off"], default="auto",
                   help="the engine's CUDA graphs (auto: on for CUDA; on a CPU, 'on' runs the padded path eagerly)")
    p.add_argument("--device", default="auto", help="auto: cuda when present, else cpu")
    p.add_argument("--dtype", default="auto", help="auto: bfloat16 on cuda, float32 on cpu")
    return p


def engine_options(args: argparse.Namespace) -> dict:
    """SpecEngine keyword arguments chosen on the command line."""
    return {"backend": args.backend, "cuda_graphs": {"auto": None, "on": True, "off": False}[args.cuda_graphs]}


def setup(args: argparse.Namespace, needs_gpu: bool = True) -> tuple[torch.device, torch.dtype]:
    """Device and dtype of a run; with ``needs_gpu`` the real shape refuses to run on a CPU."""
    device, dtype = resolve_device(args.device, args.dtype)
    if needs_gpu and device.type != "cuda" and not args.tiny:
        raise SystemExit("the real (8B) shape needs a CUDA GPU; pass --tiny for a CPU smoke run")
    torch.manual_seed(0)
    return device, dtype


def environment(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    """What a result was measured on."""
    import transformers

    try:
        import flashinfer
        flashinfer_version = flashinfer.__version__
    except (ImportError, OSError):
        flashinfer_version = None
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "transformers": transformers.__version__, "flashinfer": flashinfer_version,
            "cuda": torch.version.cuda, "backend": args.backend,
            "dtype": str(dtype).removeprefix("torch."), "tiny": args.tiny,
            "git_commit": git_commit(), "git_dirty": git_dirty()}


def write_result(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, bench: str,
                 result: dict) -> dict:
    """Prefix ``result`` with the environment and write it to ``args.out`` as JSON."""
    result = {"bench": bench, **environment(args, device, dtype), **result}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return result


def print_table(rows: list[dict], columns: list[str]) -> None:
    """A fixed-width table of ``rows`` (floats with 3 significant decimals)."""

    def cell(v) -> str:
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    widths = [max(len(c), *(len(cell(r.get(c, ""))) for r in rows)) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(cell(r.get(c, "")).rjust(w) for c, w in zip(columns, widths)))
