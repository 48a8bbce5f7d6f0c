"""Host work per engine step: the time an EAGLE-2 speculative step (and a plain decode step, and
the EAGLE engine's plain step with speculation off, which feeds its head) spends outside its
device work, at several batch sizes.

    .venv/bin/python bench/host_work.py                     # batch 1, 8, 32 on this CPU
    .venv/bin/python bench/host_work.py --batch-sizes 1 64 --steps 50
    .venv/bin/python bench/host_work.py --verifier rejection --temperature 0.7   # sampled

Target and EAGLE head are tiny random models (``bench/gpu/spec_step.py --tiny``'s), so their
forwards cost little, and the engine runs the padded CUDA-graph path (eagerly on a CPU). The
device work is timed and subtracted from the step: what a GPU replays from graphs (every model
forward, and the EAGLE-2 beam's build after the root, builder ops included) and the lm_heads'
logits. What is left is the engine's, builder's, drafter's, runner's, verifier's and attention
planner's host work, which a GPU step adds to its kernels (the smaller ops it leaves, such as
the verifier's argmax, are kernels on a GPU too; so is a sampled verifier's work over the tree's
[B, N, V] probabilities, which makes its times here larger than its ops). One thread, best of 3. The ``_ops`` columns
count the torch ops a step dispatches outside that device work: each is a kernel launch or a
host op on a GPU, and unlike the times they do not depend on the machine (a CPU run's spec step
also checks its tree's structure, token ids and root on the host, about 50 ops a GPU step leaves out).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).parent / "gpu"))
from spec_step import TREE, random_eagle_head  # noqa: E402

from drafters.eagle import EagleDrafter  # noqa: E402
from specflow.bench import gpu  # noqa: E402
from specflow.engine import SpecEngine  # noqa: E402
from specflow.runtime.beam import Beam  # noqa: E402
from specflow.sampling import SamplingParams  # noqa: E402
from trees.eagle2 import Eagle2Builder  # noqa: E402
from specflow.config import build_component  # noqa: E402
from specflow.registry import VERIFIERS  # noqa: E402


class DeviceTimer:
    """Seconds spent inside the given methods while in its ``with`` block, outermost calls only:
    the device work a CPU runs in place (model forwards and an EAGLE-2 beam's whole build
    after the root, which a GPU replays from CUDA graphs, and the lm_heads' logits)."""

    def __init__(self, *methods: tuple[type, str]):
        self.methods = methods

    def __enter__(self) -> "DeviceTimer":
        self.seconds, self._depth = 0.0, 0
        self._originals = [getattr(owner, name) for owner, name in self.methods]

        def timed(method):
            def call(*args, **kwargs):
                t0, self._depth = time.perf_counter(), self._depth + 1
                try:
                    return method(*args, **kwargs)
                finally:
                    self._depth -= 1
                    if not self._depth:
                        self.seconds += time.perf_counter() - t0
            return call

        for (owner, name), method in zip(self.methods, self._originals):
            setattr(owner, name, timed(method))
        return self

    def __exit__(self, *exc) -> None:
        for (owner, name), method in zip(self.methods, self._originals):
            setattr(owner, name, method)


class HostOps(TorchDispatchMode):
    """Counts the torch ops dispatched while ``timer`` is outside the device work it times."""

    def __init__(self, timer: DeviceTimer):
        super().__init__()
        self.timer, self.count = timer, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += not self.timer._depth
        return func(*args, **(kwargs or {}))


PROMPT_LEN = 16


def max_new_tokens(steps: int) -> int:
    """Tokens a request may commit in ``host_work``: 4 + 4 x steps engine steps of at most depth + 1."""
    return (4 + 4 * steps) * (TREE["depth"] + 1)


def host_work(engine: SpecEngine, batch: int, steps: int, timer: DeviceTimer,
              temperature: float = 0.0) -> tuple[float, float]:
    """``batch`` requests running: (best of 3 milliseconds per step outside the device work, torch
    ops per step dispatched there)."""
    vocab = engine.runner.model.config.vocab_size
    params = SamplingParams(temperature=temperature, max_tokens=max_new_tokens(steps), ignore_eos=True)
    rids = [engine.add_request(torch.randint(3, vocab, (PROMPT_LEN,)).tolist(), params) for _ in range(batch)]
    for _ in range(4):  # prefill, then steps that record every graph shape
        engine.step()
    best = float("inf")
    for _ in range(3):
        timer.seconds, t0 = 0.0, time.perf_counter()
        for _ in range(steps):
            engine.step()
        best = min(best, (time.perf_counter() - t0 - timer.seconds) / steps * 1e3)
    with HostOps(timer) as ops:
        for _ in range(steps):
            engine.step()
    assert len(engine.scheduler.running) == batch, "a request finished or was preempted while timed"
    for rid in rids:
        engine.abort(rid)
    return best, ops.count / steps


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--verifier", default="greedy", choices=VERIFIERS.names())
    p.add_argument("--temperature", type=float, default=0.0)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    device, dtype = torch.device("cpu"), torch.float32
    target = gpu.random_llama(gpu.llama_config(True), device, dtype)
    max_b = max(args.batch_sizes)
    # per request: prompt, output, one tree, and the graphs' padding of a tree level
    kv_tokens = max_b * (PROMPT_LEN + max_new_tokens(args.steps) + 2 * TREE["num_draft_tokens"])
    common = dict(backend="torch", cuda_graphs=True, kv_cache_tokens=kv_tokens, max_batch_size=max_b)
    verifier = build_component(VERIFIERS, {"type": args.verifier})
    plain = SpecEngine(target, verifier=verifier, **common)
    drafter = EagleDrafter(random_eagle_head(target, device, dtype), kv_cache_tokens=kv_tokens, runtime=plain.runtime)
    spec = SpecEngine(target, drafter=drafter, tree=Eagle2Builder(**TREE), verifier=verifier, **common)
    device_work = [(model, name) for model in (type(target), type(drafter.head)) for name in ("forward", "compute_logits")]
    rows = []
    with DeviceTimer(*device_work, (Beam, "_replay")) as timer:
        for b in args.batch_sizes:
            (decode_ms, decode_ops), (spec_ms, spec_ops) = (host_work(e, b, args.steps, timer, args.temperature)
                                                        for e in (plain, spec))
            spec.spec_max_batch_size = 0  # speculation off: plain steps that feed the head
            paused_ms, paused_ops = host_work(spec, b, args.steps, timer, args.temperature)
            spec.spec_max_batch_size = None
            rows.append({"batch_size": b, "decode_host_ms": decode_ms, "spec_host_ms": spec_ms,
                         "paused_host_ms": paused_ms, "decode_ops": decode_ops, "spec_ops": spec_ops,
                         "paused_ops": paused_ops})
    gpu.print_table(rows, list(rows[0]))
    return rows


if __name__ == "__main__":
    torch.set_num_threads(1)  # host work is single-threaded Python: keep torch's ops so too
    main()
