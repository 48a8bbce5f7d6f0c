"""A full speculative step (an EAGLE-shaped head drafting an EAGLE-2 tree of topk 8, depth 5 and
64 nodes, greedy verification, commit) against a plain decode step, and tokens/s at batch 1, 8,
32 and 64 with and without speculation, on a Llama-3.1-8B-shaped target; target and head have
random bfloat16 weights made on the GPU (issue 5, item 4).

    python bench/gpu/spec_step.py --out bench/results/spec_step.json
    python bench/gpu/spec_step.py --prompt-len 4096 --batch-sizes --out bench/results/spec_step_ctx4096.json
    python bench/gpu/spec_step.py --tiny --out /tmp/spec_step.json   # CPU smoke run

``--batch-sizes`` with no sizes leaves the tokens/s out: each of those runs prefills its prompts,
which a long prompt makes most of its time.

Random weights make acceptance meaningless (the head has not learnt the target): read the step
times and the cost of speculation from this benchmark, and tokens/s only together with the
tokens committed per step reported beside them; speedups need a trained head.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from drafters.eagle import EagleDrafter
from specflow.bench import gpu
from specflow.engine import SpecEngine
from specflow.models.eagle import EagleHead
from specflow.sampling import SamplingParams
from trees.eagle2 import Eagle2Builder
from verifiers.greedy import GreedyVerifier

REAL = dict(prompt_len=128, new_tokens=32, batch_sizes=[1, 8, 32, 64], iters=20, warmup=3, repeats=1)
TINY = dict(prompt_len=16, new_tokens=4, batch_sizes=[1, 8], iters=2, warmup=1, repeats=1)
TREE = dict(topk=8, depth=5, num_draft_tokens=64)


def random_eagle_head(target, device: torch.device, dtype: torch.dtype) -> EagleHead:
    """An EAGLE-1/2 head shaped like the public Llama-3-8B ones: fc [H, 2H] and one decoder layer
    of the target's shape, over the target's embedding and LM head."""
    cfg = dataclasses.replace(target.config, num_hidden_layers=1)
    with torch.device("meta"):
        head = EagleHead(cfg, target.embed_tokens, target.lm_head, bias=True)
    return gpu.random_init_(head, device, dtype, seed=1)


def run(args) -> dict:
    device, dtype = gpu.setup(args)
    s = dict(TINY if args.tiny else REAL)
    s.update({k: v for k, v in (("prompt_len", args.prompt_len), ("batch_sizes", args.batch_sizes)) if v is not None})
    cfg = gpu.llama_config(args.tiny)
    target = gpu.random_llama(cfg, device, dtype)
    head = random_eagle_head(target, device, dtype)
    max_b = max(s["batch_sizes"], default=1)
    scratch = 2 * TREE["num_draft_tokens"]  # a tree, and the graphs' padding of a tree level
    step_tokens = (s["iters"] + s["warmup"] + 4) * (TREE["depth"] + 1)  # the most one timed request of step_ms commits
    kv_tokens = max(max_b * (s["prompt_len"] + s["new_tokens"] + scratch), s["prompt_len"] + step_tokens + scratch)
    common = dict(**gpu.engine_options(args), kv_cache_tokens=kv_tokens, max_batch_size=max_b)
    plain = SpecEngine(target, verifier=GreedyVerifier(), **common)
    drafter = EagleDrafter(head, kv_cache_tokens=kv_tokens, runtime=plain.runtime)  # the engine's backend, graphs
    spec = SpecEngine(target, drafter=drafter, tree=Eagle2Builder(**TREE), verifier=GreedyVerifier(), **common)

    prompts = torch.randint(3, cfg.vocab_size, (max_b, s["prompt_len"])).tolist()
    decode_ms, _ = gpu.step_ms(plain, prompts[0], s["iters"], s["warmup"], device)
    spec_ms, spec_step_tokens = gpu.step_ms(spec, prompts[0], s["iters"], s["warmup"], device, TREE["depth"] + 1)
    # back to back, as in a running generation: plain decoding hides its launch behind the last forward
    decode_steady = gpu.steady_step_ms(plain, prompts[0], s["iters"], s["warmup"], device)
    spec_steady = gpu.steady_step_ms(spec, prompts[0], s["iters"], s["warmup"], device, TREE["depth"] + 1)

    params = SamplingParams(temperature=0.0, max_tokens=s["new_tokens"], ignore_eos=True)
    last = {}  # engine name -> outputs of its latest run

    def generate(name: str, engine: SpecEngine, batch: list[list[int]]):
        return lambda: last.__setitem__(name, engine.generate(batch, params))

    rows = []
    for b in s["batch_sizes"]:
        t_plain, t_spec = gpu.best_seconds([generate("plain", plain, prompts[:b]), generate("spec", spec, prompts[:b])],
                                           device, s["repeats"])
        rows.append({"batch_size": b, "plain_tok_s": b * s["new_tokens"] / t_plain,
                     "spec_tok_s": b * s["new_tokens"] / t_spec, "spec_tokens_per_step": gpu.tokens_per_step(last["spec"])})
    gpu.print_table([{"": "decode step", "ms": decode_ms}, {"": "spec step", "ms": spec_ms}], ["", "ms"])
    if rows:
        gpu.print_table(rows, ["batch_size", "plain_tok_s", "spec_tok_s", "spec_tokens_per_step"])
    result = {
        "model": gpu.shape_of(cfg),
        "head": {"type": "eagle", "num_hidden_layers": 1, "fc": [cfg.hidden_size, 2 * cfg.hidden_size]},
        "tree": {"type": "eagle2", **TREE},
        "verifier": "greedy",
        "cuda_graphs": spec.runner.graphs is not None,
        "attention": type(spec.runner.attn).__name__,  # what backend "auto" resolved to
        "drafter_cuda_graphs": drafter.runner.runner.graphs is not None,
        "shapes": {"prompt_len": s["prompt_len"], "new_tokens": s["new_tokens"], "batch_sizes": s["batch_sizes"],
                   "iters": s["iters"], "warmup": s["warmup"], "repeats": s["repeats"]},
        "decode_step_ms": decode_ms,
        "spec_step_ms": spec_ms,
        "spec_step_ratio": spec_ms / decode_ms,
        # the same steps run back to back: the cost of speculation inside a running generation
        # (the idle-start times above add a decode step's launch, which a running decode hides)
        "steady_step_ms": {"decode": decode_steady, "spec": spec_steady},
        "spec_step_ratio_steady": spec_steady / decode_steady,
        "spec_step_tokens_per_step": spec_step_tokens,
        "throughput": rows,
        "note": "random weights: the head has not learnt the target, so acceptance (tokens per step) "
                "is meaningless and spec_tok_s is no speedup estimate; a trained head commits "
                "more tokens per step at the same step time",
    }
    # batch 1: where the host waits for the GPU in a step (blocking copies and reads)
    result["decode_sync_points"] = gpu.sync_points(plain, prompts[0], device)
    result["spec_sync_points"] = gpu.sync_points(spec, prompts[0], device, max_tokens_per_step=TREE["depth"] + 1)
    result = gpu.write_result(args, device, dtype, "spec_step", result)  # before the optional profile
    if args.profile:  # batch 1, where host work matters most
        gpu.profile_steps(spec, prompts[0], device, Path(args.out).with_suffix(".profile.txt"),
                          max_tokens_per_step=TREE["depth"] + 1)
    return result


def main(argv: list[str] | None = None) -> dict:
    p = gpu.parser(__doc__)
    p.add_argument("--prompt-len", type=int, help=f"tokens of each prompt (default {REAL['prompt_len']}, "
                                                   f"--tiny {TINY['prompt_len']})")
    p.add_argument("--batch-sizes", type=int, nargs="*", help=f"of the tokens/s runs (default {REAL['batch_sizes']}, "
                                                               f"--tiny {TINY['batch_sizes']})")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    main()
