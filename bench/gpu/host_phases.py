"""Where an engine step's wall time goes, phase by phase, on the GPU: the 8B-shaped EAGLE step of
spec_step.py, a plain decode step of the same target, and the shipped tiny family's EAGLE-3
pipeline (whose GPU steps are all host work). Each phase is a method wrapped with a wall-clock
timer (a profiler's own overhead inflates the many small host calls it is asked about); phases
nest, so their times overlap. `to_host` is where the step waits for its verdict from the GPU.

    python bench/gpu/host_phases.py --out bench/results/host_phases.txt
    python bench/gpu/host_phases.py --tiny --out /tmp/host_phases.txt   # CPU smoke run
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from spec_step import TREE, random_eagle_head  # noqa: E402

from drafters.eagle import EagleDrafter  # noqa: E402
from specflow import spec_step, tree  # noqa: E402
from specflow.bench import gpu  # noqa: E402
from specflow.engine import SpecEngine  # noqa: E402
from specflow.runtime import attention, beam, cuda_graph, draft_runner, flashinfer_backend, transfer  # noqa: E402
from specflow.sampling import SamplingParams  # noqa: E402
from trees import eagle2  # noqa: E402
from verifiers.greedy import GreedyVerifier  # noqa: E402

PHASES = [  # (owner, attribute): a module attribute is wrapped where the engine looks it up
    (spec_step.SpeculativeDecoding, "step"), (spec_step.SpeculativeDecoding, "_draft"),
    (spec_step.SpeculativeDecoding, "_target_forward"), (spec_step.SpeculativeDecoding, "_verify"),
    (spec_step.SpeculativeDecoding, "_commit"), (spec_step, "to_host"), (tree, "to_host"),
    (transfer.HostCopy, "wait"),
    (eagle2.Eagle2Builder, "build"), (draft_runner.TreeDraftRunner, "beam"), (draft_runner.TreeDraftRunner, "_feed"),
    (beam.Beam, "run"), (cuda_graph.GraphRunner, "forward"), (torch.cuda.CUDAGraph, "replay"),
    (flashinfer_backend.FlashinferBackend, "plan"), (attention.TorchBackend, "plan"),
]


def timed(owner, name: str, totals: dict[str, float]) -> None:
    """Wrap ``owner.name`` to add its wall time to ``totals``."""
    fn, label = getattr(owner, name), f"{getattr(owner, '__name__', owner)}.{name}"

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[label] = totals.get(label, 0.0) + time.perf_counter() - t0
    setattr(owner, name, wrapper)


def phases(engine: SpecEngine, prompt: list[int], device: torch.device, totals: dict[str, float],
           steps: int = 20) -> str:
    """Milliseconds per step of each phase over ``steps`` steps of one running request."""
    rid = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=40 * (steps + 8), ignore_eos=True))
    for _ in range(6):  # prefill, then graph captures
        engine.step()
    gpu.synchronize(device)
    totals.clear()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    gpu.synchronize(device)
    step = (time.perf_counter() - t0) * 1e3 / steps
    engine.abort(rid)
    lines = [f"ms per step: {step:.3f} (phases below nest, so they overlap)"]
    lines += [f"  {k:45s} {v * 1e3 / steps:8.3f}" for k, v in sorted(totals.items(), key=lambda kv: -kv[1])]
    return "\n".join(lines) + "\n"


def main() -> None:
    args = gpu.parser(__doc__).parse_args()
    device, dtype = gpu.setup(args)
    totals: dict[str, float] = {}
    for owner, name in PHASES:
        timed(owner, name, totals)
    zoo = "zoo/tiny-code"
    tiny = SpecEngine(f"{zoo}/target", {"type": "eagle3", "path": f"{zoo}/eagle3"},
                      {"type": "eagle2", "topk": 4, "depth": 6, "num_draft_tokens": 16}, {"type": "greedy"},
                      device=device, dtype="float32")
    report = (f"== tiny family, eagle3 (float32, {type(tiny.runner.attn).__name__})\n"
              + phases(tiny, tiny.tokenizer.encode("def main(") * 4, device, totals))
    del tiny
    cfg = gpu.llama_config(args.tiny)
    target = gpu.random_llama(cfg, device, dtype)
    common = dict(**gpu.engine_options(args), kv_cache_tokens=8192, max_batch_size=1)
    plain = SpecEngine(target, verifier=GreedyVerifier(), **common)
    drafter = EagleDrafter(random_eagle_head(target, device, dtype), kv_cache_tokens=8192, runtime=plain.runtime)
    spec = SpecEngine(target, drafter=drafter, tree=eagle2.Eagle2Builder(**TREE), verifier=GreedyVerifier(), **common)
    prompt = torch.randint(3, cfg.vocab_size, (128,)).tolist()
    attn, shape = type(spec.runner.attn).__name__, "tiny" if args.tiny else "8B"
    report += f"\n== {shape}-shaped EAGLE step, {TREE} ({dtype}, {attn})\n" + phases(spec, prompt, device, totals)
    report += f"\n== {shape}-shaped plain decode step ({dtype}, {attn})\n" + phases(plain, prompt, device, totals)
    env = gpu.environment(args, device, dtype)
    report = f"{ {k: env[k] for k in ('device', 'torch', 'flashinfer', 'backend') if k in env} }\n\n" + report
    Path(args.out).write_text(report)
    print(report)


if __name__ == "__main__":
    main()
