"""Is a pipeline lossless? A chi-square test of its sampled output against the target's exact
distribution, through the whole engine, on a target small enough to enumerate.

The first ``new_tokens`` tokens after a prompt have V ** new_tokens possible values; on a 6-token
vocabulary their exact joint law is V ** (new_tokens - 1) target forwards away (``exact_joint``),
and a few thousand seeded requests estimate the engine's (``sampled_counts``). A pipeline that
keeps the target's distribution passes at any sample size; a lossy one fails once the samples
resolve its bias (the shipped tests run 3000: a threshold verifier at 0.05 fails at p ~ 0).

    from specflow.bench.distribution import check_lossless
    p = check_lossless({"type": "ngram"}, {"type": "chain", "depth": 2, "sample": True}, {"type": "rejection"})
    assert p > 1e-3

This is how tests/test_distribution.py checks the shipped pipelines. A drafter with a model of its
own needs one over the target's vocabulary (``make_random_checkpoint(dir, vocab_size=6)``).
"""

from __future__ import annotations

import itertools
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from specflow.engine import SpecEngine
from specflow.models import load_model
from specflow.models.random import make_random_checkpoint
from specflow.runtime.model_runner import ModelRunner
from specflow.sampling import SamplingBatch, SamplingParams, target_probs

VOCAB = 6
PROMPT = [1, 4, 2, 5]
NEW_TOKENS = 3  # one from prefill, then speculative steps
PARAMS = dict(temperature=0.9, top_k=5, top_p=0.95)  # truncations too: the verifier must apply them


def small_target(path: str | Path, seed: int = 3) -> Path:
    """A random-weight Llama over ``VOCAB`` tokens, peaked enough that drafts get accepted and
    rejected (initializer_range 0.15), written to ``path``."""
    return make_random_checkpoint(Path(path), hidden_size=32, num_layers=2, num_heads=2, vocab_size=VOCAB,
                                  initializer_range=0.15, seed=seed, tokenizer=False)


def exact_joint(model, prompt: list[int] = PROMPT, params: dict = PARAMS, new_tokens: int = NEW_TOKENS,
                adjust: Callable[[Tensor, list[int]], Tensor] | None = None) -> Tensor:
    """[V ** new_tokens] float64: the probability of every continuation of ``prompt`` (row-major
    over its tokens) under the processed target distribution: the target's logits, then
    ``adjust(logits [V], tokens generated before)`` when given (penalties, written out), then
    temperature and the truncations of ``params``."""
    v = model.config.vocab_size
    runner, sampling = ModelRunner(model, num_pages=4096), SamplingBatch.from_params([SamplingParams(**params)], [0])
    joint = torch.zeros([v] * new_tokens, dtype=torch.float64)
    for before in itertools.product(range(v), repeat=new_tokens - 1):
        logits = runner.extend([0], [prompt + list(before)]).logits[len(prompt) - 1:]  # [new_tokens, V]
        runner.release([0])
        if adjust is not None:
            logits = torch.stack([adjust(logits[k], list(before[:k])) for k in range(new_tokens)])
        p = target_probs(logits[None], sampling)[0].double()  # [new_tokens, V]: p(.), p(.|a), ...
        joint[before] = torch.prod(p[torch.arange(new_tokens - 1), list(before)]) * p[-1]
    return joint.flatten()


def sampled_counts(engine: SpecEngine, samples: int, prompt: list[int] = PROMPT, params: dict = PARAMS,
                   new_tokens: int = NEW_TOKENS, tested: list[int] | None = None) -> Tensor:
    """[V ** new_tokens] how often ``samples`` seeded requests of ``prompt`` generated each
    continuation; ``tested``, when given, gets each request's number of drafts the verifier tested."""
    v = engine.model.config.vocab_size
    outs = engine.generate([prompt] * samples, [SamplingParams(seed=i, max_tokens=new_tokens, ignore_eos=True,
                                                               **params) for i in range(samples)])
    counts = torch.zeros(v ** new_tokens)
    for o in outs:
        counts[continuation(o.token_ids, v)] += 1
    if tested is not None:
        tested += [sum(o.tried_depths) for o in outs]
    return counts


def continuation(tokens: list[int], vocab: int) -> int:
    """The index of a continuation in ``exact_joint``'s order."""
    return sum(t * vocab ** (len(tokens) - 1 - i) for i, t in enumerate(tokens))


def chi_square_pvalue(counts: Tensor, probs: Tensor, pool_below: float = 5.0) -> float:
    """Goodness of fit of ``counts`` to the law ``probs`` (same shape): cells expecting fewer than
    ``pool_below`` counts are pooled, so the chi-square approximation holds; a count where the law
    has no mass makes p 0 (the target cannot produce that output)."""
    counts, probs = counts.flatten().double(), probs.flatten().double()
    possible = probs > 1e-12
    if counts[~possible].sum() > 0:
        return 0.0
    counts, expected = counts[possible], probs[possible] / probs[possible].sum() * counts.sum()
    big = expected >= pool_below
    if not bool(big.all()):  # one pooled cell (dropped if it expects nothing)
        counts = torch.cat([counts[big], counts[~big].sum()[None]])
        expected = torch.cat([expected[big], expected[~big].sum()[None]])
    statistic = float(((counts - expected) ** 2 / expected).sum())
    dof = len(counts) - 1
    if dof < 1:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def check_lossless(drafter: Any, tree: Any, verifier: Any, target: str | Path | None = None, samples: int = 3000,
                   prompt: list[int] = PROMPT, params: dict = PARAMS, **engine: Any) -> float:
    """The chi-square p-value of a pipeline's first ``NEW_TOKENS`` sampled tokens against the
    target's exact law (``small_target`` when ``target`` is None); ``engine`` are SpecEngine
    options. Lossless pipelines give p uniform on [0, 1]: below 1e-3, suspect the pipeline. A
    warning says when the verifier tested fewer drafts than a tenth of the requests: the test
    then says little of it (a lookup drafter finds little in ``PROMPT``: give it a prompt with
    repeats)."""
    with tempfile.TemporaryDirectory(prefix="specflow-lossless-") as tmp:
        model = load_model(target or small_target(tmp), device="cpu", dtype="float32")
        spec = SpecEngine(model, drafter, tree, verifier, **{"kv_cache_tokens": 8192, "max_batch_size": 128} | engine)
        tested: list[int] = []
        counts = sampled_counts(spec, samples, prompt, params, tested=tested)
        if sum(tested) < samples / 10:
            warnings.warn(f"check_lossless: the verifier tested {sum(tested)} drafts in {samples} requests, so "
                          f"the p-value says little of the pipeline; draft more (prompt=...)", stacklevel=2)
        return chi_square_pvalue(counts, exact_joint(model, prompt, params))
