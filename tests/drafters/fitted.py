"""Heads fitted to a target's own greedy trajectories (exact linear interpolation: fewer
trajectory positions than feature dimensions), so their drafts along those trajectories are the
target's tokens. Generation then accepts them only if the drafter pairs each token with the
right target feature at run time: an end-to-end check of the alignment conventions."""

from __future__ import annotations

import torch

from specflow import SamplingParams, SpecEngine
from specflow.runtime.model_runner import ModelRunner


def trajectories(target, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt followed by the target's greedy continuation."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = SpecEngine(target, kv_cache_tokens=1024).generate(prompts, params)
    return [p + o.token_ids for p, o in zip(prompts, outs)]


def target_states(target, seqs: list[list[int]], taps: tuple[int, ...] = ()) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sequence: final hidden states [n, H] and the concatenated taps [n, len(taps) * H]."""
    out = ModelRunner(target, num_pages=1024).extend(list(range(len(seqs))), seqs, logits="none", taps=taps)
    taps_cat = torch.cat(out.taps, -1) if taps else out.hidden[:, :0]
    return [(out.hidden[out.rows(i)], taps_cat[out.rows(i)]) for i in range(len(seqs))]


def fit(x: torch.Tensor, y: torch.Tensor, bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A linear map with ``weight @ x_i (+ bias) == y_i`` for every row (needs rows < columns)."""
    if bias:
        x = torch.cat([x, torch.ones(len(x), 1)], 1)
    assert x.shape[0] < x.shape[1], "an exact fit needs fewer samples than input features"
    sol = torch.linalg.lstsq(x.double(), y.double(), driver="gelsd").solution.float()  # [in (+1), out]
    torch.testing.assert_close(x @ sol, y, atol=1e-3, rtol=1e-3)
    return (sol[:-1].T.contiguous(), sol[-1].contiguous()) if bias else (sol.T.contiguous(), None)
