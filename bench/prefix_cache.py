"""Prefix caching on a chat-like workload: requests that share a long system prompt, one after
another, each followed by a second turn that holds the first turn and its answer. The same
requests run through an engine without prefix caching and one with it, in this process; printed:
prompt tokens prefilled, time to first token (the first step's wall time) and total wall time,
with the ratios.

    .venv/bin/python bench/prefix_cache.py                           # zoo/tiny-code, EAGLE-3, CPU
    .venv/bin/python bench/prefix_cache.py --drafter none --system-tokens 2000 --out runs/bench/prefix.json

The shipped target is tiny (2.6M parameters), so on a CPU its prefill is cheap next to the
engine's per-step work: the token counts are the machine-independent number, the times show
what is left of them here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from specflow.engine import SpecEngine
from specflow.sampling import SamplingParams

ZOO = "zoo/tiny-code"
DRAFTERS = {"none": None, "eagle3": {"type": "eagle3", "path": f"{ZOO}/eagle3"},
            "eagle": {"type": "eagle", "path": f"{ZOO}/eagle"}, "ngram": {"type": "ngram"}}
TREE = {"type": "eagle2", "topk": 4, "depth": 4, "num_draft_tokens": 16}
QUESTIONS = ["def parse(line):\n", "class Cache:\n    def get(self, key):\n", "for path in paths:\n",
             "def merge(a, b):\n", "import json\n\ndef load(path):\n", "while queue:\n    node = "]


def run(engine: SpecEngine, system: list[int], follow_up: list[int], params: SamplingParams) -> dict:
    """Every question as a first turn, then its second turn, one request at a time."""
    prefilled, ttft, extend = [0], [], engine.runner.extend

    def counting(ids, tokens, **kw):
        if kw.get("logits") == "last":  # a prefill
            prefilled[0] += sum(map(len, tokens))
        return extend(ids, tokens, **kw)

    engine.runner.extend = counting
    t0 = time.perf_counter()
    for question in QUESTIONS:
        prompt = system + engine.encode(question)
        for turn in range(2):
            engine.add_request(prompt, params)
            t = time.perf_counter()
            outs = engine.step()   # the prefill and the first step
            ttft.append(time.perf_counter() - t)
            while engine.has_unfinished():
                outs += engine.step()
            prompt = prompt + outs[0].token_ids + follow_up
    return {"prefilled_tokens": prefilled[0], "ttft_ms_median": 1e3 * statistics.median(ttft),
            "seconds": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", choices=DRAFTERS, default="eagle3")
    parser.add_argument("--system-tokens", type=int, default=1000, help="length of the shared system prompt")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    node = DRAFTERS[args.drafter]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    results = {}
    for caching in (False, True, False, True):  # twice each, alternating: the second of each is kept
        engine = SpecEngine(f"{ZOO}/target", node, TREE if node else None, {"type": "greedy"}, device="cpu",
                            dtype="float32", prefix_caching=caching)
        text = "# You write short, correct Python.\n" * (args.system_tokens // 8 + 1)
        system, follow_up = engine.encode(text)[:args.system_tokens], engine.encode("\n# next\n")
        results["prefix_caching" if caching else "baseline"] = run(engine, system, follow_up, params)
    base, cached = results["baseline"], results["prefix_caching"]
    results["ratios"] = {"prefilled_tokens": cached["prefilled_tokens"] / base["prefilled_tokens"],
                         "ttft": cached["ttft_ms_median"] / base["ttft_ms_median"],
                         "seconds": cached["seconds"] / base["seconds"]}
    results["settings"] = {"drafter": args.drafter, "system_tokens": args.system_tokens, "requests": 2 * len(QUESTIONS),
                           "max_tokens": args.max_tokens, "threads": args.threads, "torch": torch.__version__}
    for name in ("baseline", "prefix_caching"):
        r = results[name]
        print(f"{name:15s} prefilled {r['prefilled_tokens']:6d} tokens, TTFT {r['ttft_ms_median']:7.1f} ms (median), "
              f"{r['seconds']:6.2f} s")
    print("with / without: " + ", ".join(f"{k} {v:.3f}" for k, v in results["ratios"].items()))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
