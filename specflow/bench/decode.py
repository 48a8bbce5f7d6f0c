"""Plain-decoding throughput of specflow against ``transformers`` generate, in the same process."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from specflow.bench.provenance import device_name, git_commit, git_dirty
from specflow.engine import SpecEngine
from specflow.sampling import SamplingParams


def best_times(fns: list, repeats: int) -> list[float]:
    """Best-of-``repeats`` seconds of each function, alternating them after one warm-up each,
    so a noisy machine slows both alike."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def run_decode_bench(target: str, batch_sizes: list[int] = (1, 8), max_tokens: int = 64,
                     prompt_len: int = 32, repeats: int = 3, out: str | None = None) -> list[dict]:
    """Greedy decoding of ``max_tokens`` tokens per request (EOS ignored) at each batch size,
    best of ``repeats`` runs each, specflow and transformers alternating in one process; each row
    says whether both generated the same tokens (``same_tokens``: they timed the same work)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    engine = SpecEngine(target, device="cpu", dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    vocab = engine.model.config.vocab_size
    rows = []
    print(f"{'batch':>5} {'specflow tok/s':>15} {'transformers tok/s':>19} {'ratio':>6} {'same tokens':>12}")
    for bs in batch_sizes:
        prompts = torch.randint(1, vocab, (bs, prompt_len))
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

        def hf_generate() -> list[list[int]]:
            with torch.inference_mode():
                out = hf.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                                  max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=0)
            return out[:, prompt_len:].tolist()

        def ours_generate() -> list[list[int]]:
            return [o.token_ids for o in engine.generate(prompts.tolist(), params)]

        ours, theirs = best_times([ours_generate, hf_generate], repeats)
        row = {"batch_size": bs, "specflow_tok_s": bs * max_tokens / ours,
               "transformers_tok_s": bs * max_tokens / theirs, "ratio": theirs / ours,
               "same_tokens": ours_generate() == hf_generate()}
        rows.append(row)
        print(f"{bs:>5} {row['specflow_tok_s']:>15.1f} {row['transformers_tok_s']:>19.1f} {row['ratio']:>6.2f} "
              f"{str(row['same_tokens']):>12}")
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        cpu = torch.device("cpu")
        Path(out).write_text(json.dumps({"target": str(target), "device": "cpu", "device_name": device_name(cpu),
                                         "max_tokens": max_tokens, "prompt_len": prompt_len,
                                         "torch_threads": torch.get_num_threads(), "torch_version": torch.__version__,
                                         "git_commit": git_commit(), "git_dirty": git_dirty(), "rows": rows},
                                        indent=2))
    return rows
