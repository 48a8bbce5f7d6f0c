"""Logit adjustments that depend on a request's history: OpenAI's ``logit_bias``,
``frequency_penalty`` and ``presence_penalty``, the repetition penalty of CTRL (Keskar et al.,
2019; Hugging Face's and vLLM's ``repetition_penalty``) and vLLM's ``min_tokens``. They apply to
the target's raw logits, before temperature and the truncations (``target_probs``), in vLLM's
order:

    l += bias[t]                                                     logit_bias
    l = -inf at stop tokens while fewer than min_tokens tokens were generated       min_tokens
    l = l / r if l > 0 else l * r, at tokens of the prompt or the output       repetition_penalty r
    l -= f * count(t) + p * [count(t) > 0], counting the output                frequency f, presence p

A tree node's logits choose the token after its path, so its history is the request's sequence
followed by the nodes of its path below the root (the root is the sequence's last token):
``Penalties.apply`` adjusts every node by its own path, and a verifier tests each draft against
the distribution plain decoding draws from at that point. Losslessness carries over unchanged;
drafters draft from their own, unadjusted, distributions.
"""

from __future__ import annotations

from collections.abc import Iterable
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
    prompt_ids: list[int]
    output_ids: list[int]
    stop_ids: set[int]     # the tokens ``min_tokens`` holds back (eos unless ignored, stop_token_ids)


@dataclass
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
    def build(rows: list[History], vocab: int, device: torch.device) -> "Penalties | None":
        """The batch's adjustments (None when no row has any: the batch samples as it would
        without). Rows without adjustments get all-neutral ones, which leave their logits' bits
        as they are."""
        if not any(h.params.adjusts_logits for h in rows):
            return None
        b, params = len(rows), [h.params for h in rows]
        counted = [i for i, p in enumerate(params) if p.penalizes]
        biased = [i for i, p in enumerate(params) if p.logit_bias]
        out_rows, out_ids = _flat({i: rows[i].output_ids for i in counted})
        prompt_rows, prompt_ids = _flat({i: rows[i].prompt_ids for i in counted if params[i].repetition_penalty != 1})
        bias_rows, bias_ids = _flat({i: params[i].logit_bias for i in biased})
        bias_values = np.array([x for i in biased for x in params[i].logit_bias.values()], dtype=np.float32)
        holding = [i for i, h in enumerate(rows) if h.params.min_tokens > len(h.output_ids)]
        held_rows, held_ids = _flat({i: rows[i].stop_ids for i in holding})
        scalars = np.array([(p.repetition_penalty, p.frequency_penalty, p.presence_penalty) for p in params],
                           dtype=np.float32).reshape(b, 3)                                  # [B, 3]
        to_min = np.array([h.params.min_tokens - len(h.output_ids) for h in rows], dtype=np.int64)
        (out_rows, out_ids, prompt_rows, prompt_ids, bias_rows, bias_ids, bias_values, held_rows, held_ids,
         scalars, to_min) = to_device([torch.from_numpy(a) for a in (
             out_rows, out_ids, prompt_rows, prompt_ids, bias_rows, bias_ids, bias_values, held_rows, held_ids,
             scalars, to_min)], device)                                                     # one copy
        counts = torch.zeros(b, vocab, device=device).index_put_(
            (out_rows, out_ids), torch.ones_like(out_ids, dtype=torch.float32), accumulate=True)  # [B, V]
        seen = (counts > 0).index_put_((prompt_rows, prompt_ids), torch.ones_like(prompt_ids, dtype=torch.bool))
        bias = torch.zeros(b, vocab, device=device).index_put_((bias_rows, bias_ids), bias_values, accumulate=True)
        held = torch.zeros(b, vocab, dtype=torch.bool, device=device).index_put_(
            (held_rows, held_ids), torch.ones_like(held_ids, dtype=torch.bool))
        return Penalties(counts, seen, bias, held, to_min, *scalars.unbind(1))

    def after(self, tokens: Tensor, rows: Tensor) -> "Penalties":
        """These adjustments once the rows where ``rows`` [B] (bool) have generated ``tokens``
        [B] as well: plain decoding's tokens in flight, still on the device."""
        counts = self.counts.scatter_add(1, tokens[:, None], rows.float()[:, None])     # [B, V]
        return Penalties(counts, self.seen | counts.gt(0), self.bias, self.held, self.to_min - rows.long(),
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


def _flat(ids: dict[int, Iterable[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(the row of every id, the ids) of ``ids``: row -> its token ids."""
    lists = [list(x) for x in ids.values()]
    flat = np.fromiter((t for x in lists for t in x), dtype=np.int64, count=sum(map(len, lists)))
    return np.repeat(np.array(list(ids), dtype=np.int64), [len(x) for x in lists]), flat
