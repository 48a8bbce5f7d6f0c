"""Logprobs of committed tokens and of prompt tokens under the target: computed on the device for
a whole batch at once and copied to the host in one transfer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from specflow.runtime.transfer import to_device, to_host

if TYPE_CHECKING:
    from specflow.models import LlamaForCausalLM
    from specflow.request import Request
    from specflow.runtime.model_runner import ExtendOutput

# prompt logits computed at once for prompt_logprobs: [rows, V] in float32 is 0.5 GiB for a
# 128k-token vocabulary; a whole 16k-token prefill at once would take ~25 GiB (the logits, a
# float32 copy, the log-softmax), past what the KV cache leaves free
PROMPT_LOGITS_ROWS = 1024


@dataclass(slots=True)
class TokenLogprob:
    """One committed token's log-probability under the target, with the most likely alternatives
    ``top`` as ``(token_id, logprob)`` pairs, best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]



def logprob_rows(logits: Tensor, tokens: Tensor, top_n: int) -> list[Tensor]:
    """Log-probabilities of ``tokens`` [T] under the raw target distribution of each row of
    ``logits`` [T, V] (before temperature, top-k, top-p and min-p: the model's own numbers, the
    same for greedy and sampled requests), where the logits lie: ``[chosen [T], top logprobs
    [T, n], their ids [T, n]]`` for the ``top_n`` most likely tokens of each row."""
    logp = torch.log_softmax(logits.float(), dim=-1)                                    # [T, V]
    chosen = logp.gather(-1, tokens.view(-1, 1))[:, 0]                                  # [T]
    top_lp, top_ids = logp.topk(min(top_n, logp.shape[-1]), dim=-1)                     # [T, n]
    return [chosen, top_lp, top_ids]


def to_token_logprobs(tokens: list[int], rows: list[Tensor], top_n: int) -> list[TokenLogprob]:
    """``logprob_rows``' tensors, on the host, as one TokenLogprob per token with its first
    ``top_n`` alternatives."""
    chosen, top_lp, top_ids = (r.tolist() for r in rows)
    return [TokenLogprob(t, lp, list(zip(ids[:top_n], lps[:top_n])))
            for t, lp, ids, lps in zip(tokens, chosen, top_ids, top_lp)]


def add_token_logprobs(logits: Tensor, entries: list[tuple[Request, list[int], list[int]]]) -> None:
    """Each entry (request, rows of ``logits``, the tokens committed there): the tokens'
    logprobs appended to the request's, computed for the whole batch with one copy back."""
    if not entries:
        return
    rows, tokens = ([i for e in entries for i in e[k]] for k in (1, 2))
    rows, device_tokens = to_device([torch.tensor(rows), torch.tensor(tokens)], logits.device)
    top_n = max(req.params.logprobs for req, _, _ in entries)
    values = to_host(logprob_rows(logits[rows], device_tokens, top_n))          # [T], [T, n], [T, n]
    start = 0
    for req, _, tokens in entries:
        end = start + len(tokens)
        req.logprobs += to_token_logprobs(tokens, [x[start:end] for x in values], req.params.logprobs)
        start = end


def add_prompt_logprobs(model: LlamaForCausalLM, chunks: list[tuple[int, Request, int, bool]],
                        out: ExtendOutput) -> None:
    """The prompt logprobs of each (row of ``out``, request, first prompt token, whether the
    prompt ends there) prefilled: prompt token i from the logits of token i - 1, which the forward
    computed only the last of. The logits are computed ``PROMPT_LOGITS_ROWS`` rows at a time and
    the logprobs come back in one copy."""
    if not chunks:
        return
    # each chunk's rows score the tokens after them, but a prompt's last row (it samples the first token)
    counts = [out.offsets[b + 1] - out.offsets[b] - last for b, _, _, last in chunks]
    rows = torch.from_numpy(np.concatenate([np.arange(out.offsets[b], out.offsets[b] + n)
                                            for (b, _, _, _), n in zip(chunks, counts)]))
    tokens = torch.from_numpy(np.concatenate([np.array(req.prompt_ids[start + 1:start + 1 + n], dtype=np.int64)
                                              for (_, req, start, _), n in zip(chunks, counts)]))
    top_n = max(req.params.prompt_logprobs for _, req, _, _ in chunks)
    parts = []
    for start in range(0, len(rows), PROMPT_LOGITS_ROWS):
        at, ids = to_device([rows[start:start + PROMPT_LOGITS_ROWS], tokens[start:start + PROMPT_LOGITS_ROWS]],
                            out.hidden.device)
        parts.append(logprob_rows(model.compute_logits(out.hidden[at]), ids, top_n))  # [r], [r, n], [r, n]
    values = to_host([torch.cat(x) for x in zip(*parts)]) if parts else []
    done = 0
    for (_, req, start, _), n in zip(chunks, counts):
        if start == 0:
            req.prompt_logprobs.append(None)  # (the first token has no context)
        if n:
            req.prompt_logprobs += to_token_logprobs(req.prompt_ids[start + 1:start + 1 + n],
                                                     [x[done:done + n] for x in values], req.params.prompt_logprobs)
        done += n
