"""Plain decoding of a Llama-3.1-8B-shaped model (random bfloat16 weights made on the GPU) at
batch 1, against the memory-bandwidth roofline and transformers' static-cache generate on the
same weights, all in one process (issue 5, item 4).

    python bench/gpu/decode_roofline.py --out bench/results/decode_roofline.json
    python bench/gpu/decode_roofline.py --tiny --out /tmp/decode_roofline.json   # CPU smoke run

Decode time excludes the prefill: each side also generates 1 token (prefill + first token) and
decode tok/s = new_tokens / (t(1 + new_tokens) - t(1)), best of ``repeats`` alternating runs.
Bandwidth convention: a device-to-device copy of ``copy_bytes`` moves 2x that (read + write);
the roofline divides it by the bytes a decode step must read (every weight but the embedding
table, of which it reads one row, plus the K/V of the mean context).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import StaticCache

from specflow.bench import gpu
from specflow.engine import SpecEngine
from specflow.runtime.cuda_graph import kv_bucket
from specflow.sampling import SamplingParams
from verifiers.greedy import GreedyVerifier

REAL = dict(prompt_len=128, new_tokens=256, repeats=2, copy_bytes=4 << 30, copy_iters=20)
TINY = dict(prompt_len=16, new_tokens=8, repeats=1, copy_bytes=16 << 20, copy_iters=3)
GOAL = 0.85  # decode_tok_s / roofline_tok_s


def copy_bandwidth_gb_s(device: torch.device, nbytes: int, iters: int) -> float:
    """GB/s (1e9) of ``dst.copy_(src)`` over ``nbytes`` buffers, counting read + write bytes."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = gpu.median_ms(lambda: dst.copy_(src), device, iters, warmup=2)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def decode_bytes(model, mean_context: float) -> tuple[int, int]:
    """(weight bytes, K/V bytes) one decode step reads: every parameter but the embedding table
    (one row of it; all of it when it is the LM head's too) and ``mean_context`` tokens of K and V
    in every layer."""
    cfg = model.config
    embed = model.embed_tokens.weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # (a tied table once)
    if model.lm_head.weight is not embed:  # an embedding table of its own: one row of it is read
        weights -= (embed.shape[0] - 1) * embed.shape[1] * embed.element_size()
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * embed.element_size()
    return weights, int(kv_per_token * mean_context)


def decode_graph(key: tuple, kv_len: int) -> bool:
    """Whether GraphRunner's graph ``key`` (batch size, tokens per request, taps, extra inputs,
    the backend's graph_key) is the one a batch-1 decode step at ``kv_len`` replays: the torch
    backend keys graphs on their KV width, flashinfer's on the decode kernel (any width)."""
    size, n, taps, inputs, backend_key = key
    width_ok = backend_key is True if isinstance(backend_key, bool) else backend_key == kv_bucket(kv_len)
    return (size, n, taps, inputs) == (1, 1, (), ()) and width_ok


def forward_ms(engine: SpecEngine, context: int, device: torch.device) -> dict[str, float]:
    """Where a decode step's time goes, at ``context`` cached tokens: one target forward through the
    runner (its host work, the kernels and the LM head), and with CUDA graphs the captured decode
    graph's replay alone (the layers' kernels only)."""
    runner, rid = engine.runner, -2  # a request of its own (the graphs' padding is -1)
    runner.extend([rid], [[3] * context], logits="none")

    def forward():
        runner.extend([rid], [[5]], logits="last")
        runner.cache.truncate(rid, context)

    out = {"runner_forward": gpu.median_ms(forward, device, iters=50, warmup=5)}
    captured = [g.graph for key, g in (runner.graphs.graphs if runner.graphs else {}).items()
                if decode_graph(key, context + 1) and g.graph is not None]
    if captured:
        out["graph_replay"] = gpu.median_ms(captured[0].replay, device, iters=50, warmup=5)
    runner.release([rid])
    return out


def run(args) -> dict:
    device, dtype = gpu.setup(args)
    s = TINY if args.tiny else REAL
    bandwidth = copy_bandwidth_gb_s(device, s["copy_bytes"], s["copy_iters"])
    cfg = gpu.llama_config(args.tiny)
    model = gpu.random_llama(cfg, device, dtype)
    engine = SpecEngine(model, verifier=GreedyVerifier(), **gpu.engine_options(args),
                        kv_cache_tokens=s["prompt_len"] + s["new_tokens"] + 64, max_batch_size=1)
    hf = gpu.hf_llama(model)
    prompt = torch.randint(3, cfg.vocab_size, (1, s["prompt_len"]))
    hf_prompt = prompt.to(device)

    def ours(n: int):
        return lambda: engine.generate(prompt.tolist(), SamplingParams(temperature=0.0, max_tokens=n,
                                                                       ignore_eos=True))

    eager = {"disable_compile": True} if args.hf_eager else {}  # GenerationConfig.disable_compile (recent transformers)

    # one static cache for every call: generate's own (cache_implementation="static") is a new one
    # per call, whose new addresses make the compiled forward record its CUDA graph again
    hf_cache = StaticCache(config=hf.config, max_cache_len=s["prompt_len"] + s["new_tokens"] + 1)

    def theirs(n: int):
        def call():
            with torch.inference_mode():  # (its tensors are inference tensors: reset in the mode too)
                hf_cache.reset()
                hf.generate(hf_prompt, attention_mask=torch.ones_like(hf_prompt), do_sample=False,
                            max_new_tokens=n, min_new_tokens=n, past_key_values=hf_cache,
                            pad_token_id=0, **eager)
        return call

    n = s["new_tokens"]
    hf_compile_error = None
    try:
        ours_full, ours_first, hf_full, hf_first = gpu.best_seconds(
            [ours(1 + n), ours(1), theirs(1 + n), theirs(1)], device, s["repeats"])
    except Exception as e:  # transformers' auto-compile (inductor/Triton) failed here: keep the run, compare eagerly
        if eager:
            raise
        hf_compile_error = f"{type(e).__name__}: {e}"[:500]
        print(f"transformers' compiled generate failed ({hf_compile_error}); timing it eagerly instead")
        eager = {"disable_compile": True}
        ours_full, ours_first, hf_full, hf_first = gpu.best_seconds(
            [ours(1 + n), ours(1), theirs(1 + n), theirs(1)], device, s["repeats"])
    decode_tok_s = n / (ours_full - ours_first)
    weight_bytes, kv_bytes = decode_bytes(model, s["prompt_len"] + (n + 1) / 2)
    roofline = bandwidth * 1e9 / (weight_bytes + kv_bytes)
    step, _ = gpu.step_ms(engine, prompt[0].tolist(), iters=50, warmup=5, device=device)
    times = forward_ms(engine, s["prompt_len"] + n // 2, device)
    result = {
        "model": gpu.shape_of(cfg),
        "shapes": {"batch_size": 1, "prompt_len": s["prompt_len"], "new_tokens": n, "repeats": s["repeats"],
                   "copy_bytes": s["copy_bytes"]},
        "decode_tok_s": decode_tok_s,
        "hf_static_tok_s": n / (hf_full - hf_first),
        "copy_bandwidth_gb_s": bandwidth,
        "weight_bytes_per_token": weight_bytes,
        "mean_kv_bytes_per_token": kv_bytes,
        "roofline_tok_s": roofline,
        "decode_vs_roofline": decode_tok_s / roofline,
        "hf_static_vs_roofline": n / (hf_full - hf_first) / roofline,
        "prefill_plus_first_token_s": {"specflow": ours_first, "hf_static": hf_first},
        # what limits decode_tok_s (medians): the kernels (graph replay against the roofline's step),
        # the runner's host work and LM head (runner forward - replay), the engine's (step - forward,
        # from an idle GPU: in a running decode the engine lands each step beside the next forward)
        "step_ms": {"roofline": 1e3 / roofline, "engine_step": step, **times,
                    "engine_outside_forward": step - times["runner_forward"]},
        "goal": f"decode_vs_roofline >= {GOAL}",
        "cuda_graphs": engine.runner.graphs is not None,
        "attention": type(engine.runner.attn).__name__,  # what backend "auto" resolved to
        "hf_compiled": device.type == "cuda" and not eager,
        "hf_compile_error": hf_compile_error,
        "note": ("bandwidth counts read + write bytes of a device-to-device copy; on CUDA transformers "
                 "compiles its static-cache decode step itself (auto-compile) unless --hf-eager, and "
                 "the compile time falls in the untimed warm-up run"),
    }
    gpu.print_table([{"": "specflow", "tok/s": decode_tok_s, "x roofline": result["decode_vs_roofline"]},
                     {"": "hf static", "tok/s": result["hf_static_tok_s"], "x roofline": result["hf_static_vs_roofline"]},
                     {"": "roofline", "tok/s": roofline, "x roofline": 1.0}], ["", "tok/s", "x roofline"])
    print(f"copy bandwidth {bandwidth:.1f} GB/s, {weight_bytes / 1e9:.3f} GB weights + "
          f"{kv_bytes / 1e6:.2f} MB K/V per token")
    print("ms per step: " + ", ".join(f"{k} {v:.3f}" for k, v in result["step_ms"].items()))
    result = gpu.write_result(args, device, dtype, "decode_roofline", result)  # before the optional profile
    if args.profile:
        gpu.profile_steps(engine, prompt[0].tolist(), device, Path(args.out).with_suffix(".profile.txt"))
    return result


def main(argv: list[str] | None = None) -> dict:
    p = gpu.parser(__doc__)
    p.add_argument("--hf-eager", action="store_true", help="turn off transformers' auto-compile")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    main()
