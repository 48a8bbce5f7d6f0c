"""The shipped zoo/tiny-code family end to end at batch 1 on its held-out prompts: specflow's
draft-model, EAGLE and EAGLE-3 pipelines (configs/zoo_eval.yaml) against plain decoding through
the same runtime, and transformers' assisted generation with the zoo draft model against
transformers' plain generate, all in one process (issue 5, item 4). Run from the repository root.

    python bench/gpu/tiny_family.py --out bench/results/tiny_family.json
    python bench/gpu/tiny_family.py --tiny --out /tmp/tiny_family.json   # CPU smoke run

Every method generates the same number of greedy tokens per prompt (EOS ignored) in float32 (the
zoo's dtype; tiny models gain nothing from bfloat16); each runs over all prompts one at a time,
best of ``repeats`` runs after a warm-up run, the methods alternating. Runs on a CPU too.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

# importing the built-in component packages registers them, also where specflow is on PYTHONPATH
# without being pip-installed (no entry points)
import drafters  # noqa: F401
import trees  # noqa: F401
import verifiers  # noqa: F401
from specflow.bench import gpu
from specflow.bench.experiment_config import load_experiment
from specflow.bench.prompts import load_suite
from specflow.engine import SpecEngine
from specflow.models import load_model, load_tokenizer
from specflow.sampling import SamplingParams

CONFIG = "configs/zoo_eval.yaml"
PIPELINES = ["draft_model", "eagle", "eagle3"]  # transformers' assistant: the draft_model pipeline's model
REAL = dict(num_prompts=None, max_tokens=None, repeats=1)  # None: all held-out prompts, the config's max_tokens
TINY = dict(num_prompts=2, max_tokens=8, repeats=1)
# transformers' assisted generation as its defaults (GenerationConfig, transformers 5) run it, named
# so that the result records what ran; set on the assistant model's generation config, which is where
# transformers' AssistedCandidateGenerator reads them (generate's keyword arguments of these are ignored)
ASSISTED = dict(num_assistant_tokens=20, num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.4)


def run(args) -> dict:
    device, dtype = gpu.setup(args, needs_gpu=False)
    s = TINY if args.tiny else REAL
    cfg, pipelines = load_experiment(CONFIG)
    pipelines = [p for p in pipelines if p.name in PIPELINES]
    target = cfg.engine.target
    model = load_model(target, device=device, dtype=dtype)
    tokenizer = load_tokenizer(target)
    prompts = [tokenizer.encode(p.text) for p in load_suite(cfg.prompts.suite)[: s["num_prompts"]]]
    max_tokens = s["max_tokens"] or cfg.sampling.max_tokens
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    kv_tokens = max(map(len, prompts)) + max_tokens + 64

    engines = {"baseline": SpecEngine(model, tokenizer=tokenizer, verifier={"type": "greedy"},
                                      **gpu.engine_options(args), kv_cache_tokens=kv_tokens, max_batch_size=1)}
    for p in pipelines:
        engines[p.name] = SpecEngine(model, p.drafter, p.tree, p.verifier, tokenizer=tokenizer,
                                     **gpu.engine_options(args), kv_cache_tokens=kv_tokens, max_batch_size=1)
    assistant = next(p for p in pipelines if p.name == "draft_model").drafter["path"]
    hf = AutoModelForCausalLM.from_pretrained(target).to(device=device, dtype=dtype).eval()
    hf_draft = AutoModelForCausalLM.from_pretrained(assistant).to(device=device, dtype=dtype).eval()
    for key, value in ASSISTED.items():  # (read from the assistant's own generation config, not generate's kwargs)
        setattr(hf_draft.generation_config, key, value)
    last: dict[str, list] = {}  # name -> per prompt outputs of the latest run

    def ours(name: str):
        def call():
            last[name] = [engines[name].generate([ids], params)[0] for ids in prompts]
        return call

    def theirs(name: str, **kwargs):
        def call():
            outs = []
            for ids in prompts:
                x = torch.tensor([ids], device=device)
                with torch.inference_mode():
                    y = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_tokens,
                                    min_new_tokens=max_tokens, pad_token_id=0, **kwargs)
                outs.append(y[0, x.shape[1]:].tolist())
            last[name] = outs
        return call

    names = [*engines, "hf", "hf_assisted"]
    fns = [ours(n) for n in engines] + [theirs("hf"), theirs("hf_assisted", assistant_model=hf_draft)]
    seconds = dict(zip(names, gpu.best_seconds(fns, device, s["repeats"])))
    tokens = {n: [o.token_ids for o in last[n]] if n in engines else last[n] for n in names}
    tok_s = {n: sum(map(len, tokens[n])) / seconds[n] for n in names}
    rows = []
    for n in names:
        plain = tokens["baseline" if n in engines else "hf"]
        row = {"method": n, "tok_s": tok_s[n], "seconds": seconds[n],
               "same_tokens_as_plain": sum(a == b for a, b in zip(tokens[n], plain)) / len(prompts)}
        if n in engines:
            steps = [a for o in last[n] for a in o.accept_lengths]
            row |= {"speedup": tok_s[n] / tok_s["baseline"], "vs_hf_assisted": tok_s[n] / tok_s["hf_assisted"],
                    "accept_length": sum(steps) / len(steps)}
        else:
            row["speedup"] = tok_s[n] / tok_s["hf"]
        rows.append(row)
    gpu.print_table(rows, ["method", "tok_s", "speedup", "vs_hf_assisted", "accept_length", "same_tokens_as_plain"])
    result = {
        "target": target, "hf_assistant": assistant, "config": CONFIG,
        "cuda_graphs": engines["baseline"].runner.graphs is not None,
        "attention": type(engines["baseline"].runner.attn).__name__,  # what backend "auto" resolved to
        "pipelines": {p.name: {"drafter": p.drafter, "tree": p.tree, "verifier": p.verifier} for p in pipelines},
        "shapes": {"batch_size": 1, "num_prompts": len(prompts), "prompt_suite": cfg.prompts.suite,
                   "max_tokens": max_tokens, "repeats": s["repeats"]},
        "hf_assisted_generation": ASSISTED,
        "rows": rows,
        "note": "speedup: specflow rows against specflow's plain decoding (baseline), hf rows against "
                "transformers' plain generate; vs_hf_assisted: specflow tokens/s over transformers "
                "assisted generation with the zoo draft model (runtime and algorithm together: each "
                "library's speedup over its own plain decoding separates them); same_tokens_as_plain: fraction of "
                "prompts whose greedy output equals the plain decoding of the same library",
    }
    return gpu.write_result(args, device, dtype, "tiny_family", result)


def main(argv: list[str] | None = None) -> dict:
    p = gpu.parser(__doc__)
    p.set_defaults(dtype="float32")  # the zoo's own dtype: greedy outputs comparable across methods
    return run(p.parse_args(argv))


if __name__ == "__main__":
    main()
