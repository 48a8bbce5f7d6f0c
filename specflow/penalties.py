"""Logit adjustments that depend on a request's history: OpenAI's ``logit_bias``,
``frequency_penalty`` and ``presence_penalty``, the repetition penalty of CTRL (Keskar et al.,
2019; Hugging Face's and vLLM's ``repetition_penalty``) and vLLM's ``min_tokens``. They apply to
the target's raw logits, before temperature and the truncations (``target_probs``), as vLLM
applies them (its min_tokens and logit_bias processors, then its penalties; the first two commute):

    l = -inf at stop tokens while fewer than min_tokens tokens were generated       min_tokens
    l += bias[t]                                                                    logit_bias
    l = l / r if l > 0 else l * r, at tokens of the prompt or the output            repetition_penalty r
    l -= f * count(t) + p * [count(t) > 0], counting the output                     frequency f, presence p

A tree node's logits choose the token after its path, so its history is the request's sequence
followed by the nodes of its path below the root (the root is the sequence's last token):
``Penalties.apply`` adjusts every node by its own path, and a verifier tests each draft against
the distribution plain decoding draws from at that point. Losslessness carries over unchanged;
drafters draft from their own, unadjusted, distributions.

``Penalties.build`` lays a batch's histories out again every step (host work linear in their
tokens), and ``apply`` makes a few [B, N, V] tensors, as ``target_probs`` does.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from specflow.runtime.transfer import to_device
from specflow.sampling import SamplingParams
from specflow.tree import DraftTree


@dataclass
class History:
    """What one request has seen, as ``Penalties.build`` reads it."""

    params: SamplingParams
    prompt_ids: Sequence[int]   # (any order, repeats or not: the repetition penalty reads which occur)
    output_ids: Sequence[int]
    stop_ids: set[int]          # the tokens ``min_tokens`` holds back (eos unless ignored, stop_token_ids)


@dataclass(slots=True)
class Penalties:
    """One batch's adjustments, on the device of the logits they adjust."""

    counts: Tensor        # [B, V] float32: each token's occurrences in the row's output
    seen: Tensor          # [B, V] bool: tokens of the row's prompt or output (repetition penalty)
    bias: Tensor          # [B, V] float32
    held: Tensor          # [B, V] bool: stop tokens of rows that min_tokens holds back now
    to_min: Tensor        # [B] int64: tokens still to generate before it lets them go (<= 0: none)
    repetition: Tensor    # [B] float32, 1 = off
    frequency: Tensor     # [B] float32
    presence: Tensor      # [B] float32

    @staticmethod
    def build(rows: list[History], vocab: int, device: torch.device) -> Penalties:
        """The batch's adjustments. Rows without any (``SamplingParams.adjusts_logits`` false) get
        neutral ones, which leave their logits' bits as they are."""
        b, params = len(rows), [h.params for h in rows]
        counted = [i for i, p in enumerate(params) if p.penalizes]
        biased = [i for i, p in enumerate(params) if p.logit_bias]
        holding = [i for i, h in enumerate(rows) if h.params.min_tokens > len(h.output_ids)]
        at = [_flat({i: rows[i].output_ids for i in counted}),                          # [2, n] (row, token id) each
              _flat({i: rows[i].prompt_ids for i in counted if params[i].repetition_penalty != 1}),
              _flat({i: params[i].logit_bias for i in biased}),
              _flat({i: rows[i].stop_ids for i in holding})]
        bias_values = np.array([x for i in biased for x in params[i].logit_bias.values()], dtype=np.float32)
        scalars = np.array([(p.repetition_penalty, p.frequency_penalty, p.presence_penalty) for p in params],
                           dtype=np.float32).reshape(b, 3)                                  # [B, 3]
        to_min = np.array([h.params.min_tokens - len(h.output_ids) for h in rows], dtype=np.int64)
        *at, bias_values, scalars, to_min = to_device(                                      # one copy
            [torch.from_numpy(a) for a in (*at, bias_values, scalars, to_min)], device)
        output, prompt, biased_at, held_at = (tuple(x) for x in at)                         # (rows, token ids)
        counts = torch.zeros(b, vocab, device=device).index_put_(                           # [B, V]
            output, torch.ones(len(output[0]), device=device), accumulate=True)
        seen = (counts > 0).index_put_(prompt, torch.ones(len(prompt[0]), dtype=torch.bool, device=device))
        bias = torch.zeros(b, vocab, device=device).index_put_(biased_at, bias_values, accumulate=True)
        held = torch.zeros(b, vocab, dtype=torch.bool, device=device).index_put_(
            held_at, torch.ones(len(held_at[0]), dtype=torch.bool, device=device))
        return Penalties(counts, seen, bias, held, to_min, *scalars.unbind(1))

    def after(self, tokens: Tensor, in_flight: Tensor) -> Penalties:
        """These adjustments once the rows where ``in_flight`` [B] (bool) have generated
        ``tokens`` [B] as well: plain decoding's tokens in flight, still on the device."""
        counts = self.counts.scatter_add(1, tokens[:, None], in_flight.float()[:, None])   # [B, V]
        return Penalties(counts, self.seen | counts.gt(0), self.bias, self.held, self.to_min - in_flight.long(),
                         self.repetition, self.frequency, self.presence)

    def apply(self, logits: Tensor, tree: DraftTree | None = None) -> Tensor:
        """[B, N, V] target logits -> [B, N, V] float32 adjusted logits, node i of ``tree`` (on
        the logits' device) after its own path below the root; no tree: one node per row, the
        token after the sequence."""
        b, n, v = logits.shape
        logits = logits.float() + self.bias[:, None]                                     # [B, N, V] a new tensor
        counts, seen, to_min = self.counts[:, None], self.seen[:, None], self.to_min[:, None]  # [B, 1, V], [B, 1]
        if tree is not None and n > 1:
            below_root = tree.mask[:, :, 1:].float()                # [B, N, N - 1] the path's nodes (padding: no one's)
            path = torch.zeros_like(logits).scatter_add_(          # [B, N, V] their tokens' counts
                2, tree.tokens[:, None, 1:].expand(b, n, n - 1), below_root)
            counts = path.add_(counts)                                                  # [B, N, V]
            seen = seen | counts.gt(0)
            to_min = to_min - tree.depth                                                 # [B, N]
        logits.masked_fill_(self.held[:, None] & (to_min > 0)[..., None], float("-inf"))
        r, f, p = (x.view(b, 1, 1) for x in (self.repetition, self.frequency, self.presence))
        logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
        return logits.sub_(f * counts + p * counts.gt(0))


def _flat(ids: dict[int, Collection[int]]) -> np.ndarray:
    """[2, n]: the row of every id, and the ids, of ``ids`` (row -> its token ids)."""
    arrays = [x.astype(np.int64, copy=False) if isinstance(x, np.ndarray) else np.fromiter(x, np.int64, len(x))
              for x in ids.values()]
    rows = np.repeat(np.array(list(ids), dtype=np.int64), [len(a) for a in arrays])
    return np.stack([rows, np.concatenate(arrays) if arrays else rows])
