"""One tree-verification extend of 16, 32 and 64 nodes against one decode step, at batch 1 over
a cached prefix, on a Llama-3.1-8B-shaped model with random bfloat16 weights (issue 5, item 4).

    python bench/gpu/verify_step.py --out bench/results/verify_step.json
    python bench/gpu/verify_step.py --prefix-len 4096 --out bench/results/verify_step_ctx4096.json
    python bench/gpu/verify_step.py --tiny --out /tmp/verify_step.json   # CPU smoke run

Both are ``runner.extend`` calls with logits for every new token, as the engine makes them: the
decode step is the root alone, the verification step a random EAGLE-2-like tree (at most
``topk`` children per node, depth <= ``depth``) with positions root + depth and its ancestor
mask. Each timed call truncates the cache back to the prefix, so every call sees the same state.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specflow.bench import gpu
from specflow.engine import SpecEngine
from specflow.tree import ancestor_mask
from verifiers.greedy import GreedyVerifier

REAL = dict(prefix_len=512, nodes=[16, 32, 64], topk=8, depth=5, iters=50, warmup=5)
TINY = dict(prefix_len=64, nodes=[16, 32, 64], topk=8, depth=5, iters=3, warmup=1)
GOAL = 1.3  # verify_step_ratio at 64 nodes


def random_tree(num_nodes: int, topk: int, depth: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """(depth [N], ancestor mask [N, N]) of a random tree: node 0 is the root, each later node
    hangs under a random earlier node of depth < ``depth`` with fewer than ``topk`` children."""
    parents, depths, children = [-1], [0], [0]
    for _ in range(1, num_nodes):
        open_nodes = [i for i in range(len(parents)) if depths[i] < depth and children[i] < topk]
        p = open_nodes[int(torch.randint(len(open_nodes), (1,), generator=gen))]
        parents.append(p)
        depths.append(depths[p] + 1)
        children[p] += 1
        children.append(0)
    return torch.tensor(depths), ancestor_mask(torch.tensor([parents]))[0]


def run(args) -> dict:
    device, dtype = gpu.setup(args)
    s = dict(TINY if args.tiny else REAL)
    if args.prefix_len is not None:
        s["prefix_len"] = args.prefix_len
    cfg = gpu.llama_config(args.tiny)
    model = gpu.random_llama(cfg, device, dtype)
    prefix = s["prefix_len"]
    engine = SpecEngine(model, verifier=GreedyVerifier(), **gpu.engine_options(args),
                        kv_cache_tokens=prefix + 2 * max(s["nodes"]) + 16, max_batch_size=1)  # + graph padding
    runner, rid = engine.runner, 0
    if runner.graphs is not None:  # as engines with N-node trees replay them: a graph per node count
        runner.enable_graphs(1, max(s["nodes"]))
    runner.extend([rid], [torch.randint(3, cfg.vocab_size, (prefix,))], logits="none")
    gen = torch.Generator().manual_seed(0)

    def step(tokens: Tensor, depth: Tensor, mask: Tensor | None):
        def call():
            runner.extend([rid], [tokens], positions=[prefix + depth], tree_masks=[mask], logits="all")
            runner.cache.truncate(rid, prefix)  # drop the scratch nodes: the next call sees the same cache
        return call

    def timed(n: int) -> float:
        # one node is a decode step: causal, as the engine sends it
        depth, mask = random_tree(n, s["topk"], s["depth"], gen) if n > 1 else (torch.zeros(1, dtype=torch.long), None)
        tokens = torch.randint(3, cfg.vocab_size, (n,), generator=gen)
        return gpu.median_ms(step(tokens, depth, mask), device, s["iters"], s["warmup"])

    decode_ms = timed(1)
    rows = [{"nodes": n, "verify_ms": timed(n)} for n in s["nodes"]]
    for r in rows:
        r["ratio"] = r["verify_ms"] / decode_ms
    assert runner.kv_len(rid) == prefix
    runner.release([rid])
    gpu.print_table([{"nodes": 1, "verify_ms": decode_ms, "ratio": 1.0}, *rows], ["nodes", "verify_ms", "ratio"])
    result = {
        "model": gpu.shape_of(cfg),
        "shapes": {"batch_size": 1, "prefix_len": prefix, "nodes": s["nodes"], "tree_topk": s["topk"],
                   "tree_depth": s["depth"], "iters": s["iters"], "warmup": s["warmup"]},
        "decode_step_ms": decode_ms,
        "cuda_graphs": runner.graphs is not None,
        "attention": type(runner.attn).__name__,  # what backend "auto" resolved to
        "verify_step_ms": {str(r["nodes"]): r["verify_ms"] for r in rows},
        "verify_step_ratio": {str(r["nodes"]): r["ratio"] for r in rows},
        "goal": f"verify_step_ratio['64'] <= {GOAL}",
        "note": "median of iters timed extends (CUDA events on a GPU, the queue drained before each); "
                "both steps compute logits for every new token, as the engine does",
    }
    return gpu.write_result(args, device, dtype, "verify_step", result)


def main(argv: list[str] | None = None) -> dict:
    p = gpu.parser(__doc__)
    p.add_argument("--prefix-len", type=int, help=f"cached tokens before the step (default {REAL['prefix_len']}, "
                                                   f"--tiny {TINY['prefix_len']})")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    main()
