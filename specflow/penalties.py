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

``PenaltyState`` keeps each adjusted request's rows on the device and adds only the tokens
committed since its last step, so a step's ``Penalties`` cost host work linear in its batch, not
in its histories; ``Penalties.build``, its reference, lays the histories out again.
``apply`` makes a few [B, N, V] tensors, as ``target_probs`` does.
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
        """The batch's adjustments from scratch (``PenaltyState.gather``'s reference). Rows without
        any (``SamplingParams.adjusts_logits`` false) get neutral ones, which leave their logits'
        bits as they are."""
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


@dataclass(slots=True)
class _Slot:
    index: int     # its rows in PenaltyState's tensors
    counted: int   # output tokens already in its counts


class PenaltyState:
    """The adjustments' state of every request that has any (``SamplingParams.adjusts_logits``),
    on the device: its output's token counts, the tokens it has seen, its bias and its stop
    tokens, as ``Penalties.build`` lays them out. A request's rows are made from its history the
    first time a step gathers it (its first token, or its first step after a preemption), then
    take only the tokens it committed since, until ``release`` (finished, aborted, preempted).
    Requests without adjustments have no rows: they gather the neutral row 0.

    Rows are slots of [S, V] tensors, grown by doubling to the most requests adjusted at once and
    never shrunk: V * 10 bytes a slot (float32 counts and bias, bool seen and stop tokens),
    1.3 MB at V = 128256. A tensor per request would hold only the requests running, but cost a
    kernel per request to update and a stack of B rows to gather; slots cost one of each a field.
    """

    def __init__(self, vocab: int, device: torch.device):
        self.slots: dict[int, _Slot] = {}   # request id -> its rows
        self.free: list[int] = []           # slots of no request
        self.counts = torch.zeros(0, vocab, device=device)                     # [S, V] float32
        self.seen = torch.zeros(0, vocab, dtype=torch.bool, device=device)    # [S, V]
        self.bias = torch.zeros(0, vocab, device=device)                       # [S, V] float32
        self.stop = torch.zeros(0, vocab, dtype=torch.bool, device=device)    # [S, V]

    def gather(self, request_ids: list[int], rows: list[History]) -> Penalties:
        """The batch's adjustments, equal to ``Penalties.build(rows)``: ``rows`` are the histories
        of ``request_ids``, each its history at its last ``gather`` and the tokens it committed
        since, and some adjust logits (a batch without any needs no Penalties). Host work linear
        in the batch and those tokens."""
        made, committed = self._account(request_ids, rows)
        index = np.array([self.slots[i].index if h.params.adjusts_logits else 0 for i, h in zip(request_ids, rows)],
                         dtype=np.int64)                                          # [B] (0: the neutral row)
        to_min = np.array([h.params.min_tokens - len(h.output_ids) for h in rows], dtype=np.int64)
        holding = np.where(to_min > 0, index, 0)                 # [B] the rows whose stop tokens are held back
        at = [_flat(committed),                                                   # [2, n] (slot, token id) each
              _flat({s: h.prompt_ids for s, h in made.items() if h.params.repetition_penalty != 1}),
              _flat({s: h.params.logit_bias for s, h in made.items() if h.params.logit_bias}),
              _flat({s: h.stop_ids for s, h in made.items() if h.params.min_tokens > len(h.output_ids)})]
        bias_values = np.array([x for h in made.values() for x in (h.params.logit_bias or {}).values()],
                               dtype=np.float32)
        scalars = np.array([(h.params.repetition_penalty, h.params.frequency_penalty, h.params.presence_penalty)
                            for h in rows], dtype=np.float32).reshape(-1, 3)    # [B, 3]
        index, holding, cleared, *at, bias_values, scalars, to_min = to_device(  # one copy
            [torch.from_numpy(a) for a in (index, holding, np.fromiter(made, np.int64, len(made)), *at, bias_values,
                                           scalars, to_min)], self.counts.device)
        self._write(cleared, *(tuple(x) for x in at), bias_values)
        counts, seen, bias, held = (x.index_select(0, i) for x, i in (           # [B, V] each
            (self.counts, index), (self.seen, index), (self.bias, index), (self.stop, holding)))
        return Penalties(counts, seen, bias, held, to_min, *scalars.unbind(1))

    def release(self, request_id: int) -> None:
        """Let go of a request's rows, if it has any (a resumed request's are made again)."""
        slot = self.slots.pop(request_id, None)
        if slot is not None:
            self.free.append(slot.index)

    def _account(self, request_ids: list[int], rows: list[History]) -> tuple[dict, dict]:
        """Give a slot to each request with adjustments that has none. Returns the slots given
        (slot -> the history to make its rows from) and the output tokens each penalized row has
        committed since its last gather (slot -> token ids), now counted."""
        made = {}
        for i, h in zip(request_ids, rows):
            if h.params.adjusts_logits and i not in self.slots:
                self.slots[i] = _Slot(self._take(), 0)
                made[self.slots[i].index] = h
        committed = {}
        for i, h in zip(request_ids, rows):
            if h.params.penalizes:
                slot = self.slots[i]
                committed[slot.index], slot.counted = h.output_ids[slot.counted:], len(h.output_ids)
        return made, committed

    def _take(self) -> int:
        """A free slot; with none, the tensors grow to twice their rows (the first time: row 0,
        neutral, and one slot)."""
        if not self.free:
            size = len(self.counts)
            for name in ("counts", "seen", "bias", "stop"):
                rows = getattr(self, name)
                setattr(self, name, torch.cat([rows, rows.new_zeros(max(2, size), rows.shape[1])]))
            self.free = list(range(len(self.counts) - 1, max(1, size) - 1, -1))  # (lowest first)
        return self.free.pop()

    def _write(self, cleared: Tensor, output: tuple[Tensor, Tensor], prompt: tuple[Tensor, Tensor],
               biased: tuple[Tensor, Tensor], stops: tuple[Tensor, Tensor], bias_values: Tensor) -> None:
        """Zero the slots ``cleared`` [m], then count the ``output`` tokens and mark them seen,
        with the ``prompt``'s, and write the others: each a (slots, token ids) pair of [n] tensors
        (empty ones skipped: no kernel)."""
        if len(cleared):
            for rows in (self.counts, self.seen, self.bias, self.stop):
                rows.index_fill_(0, cleared, 0)
        if len(output[0]):
            self.counts.index_put_(output, torch.ones(len(output[0]), device=self.counts.device), accumulate=True)
        if len(biased[0]):
            self.bias.index_put_(biased, bias_values)
        for rows, where in ((self.seen, output), (self.seen, prompt), (self.stop, stops)):
            if len(where[0]):
                rows.index_put_(where, torch.ones(len(where[0]), dtype=torch.bool, device=rows.device))


def _flat(ids: dict[int, Collection[int]]) -> np.ndarray:
    """[2, n]: the row of every id, and the ids, of ``ids`` (row -> its token ids)."""
    arrays = [x.astype(np.int64, copy=False) if isinstance(x, np.ndarray) else np.fromiter(x, np.int64, len(x))
              for x in ids.values()]
    rows = np.repeat(np.array(list(ids), dtype=np.int64), [len(a) for a in arrays])
    return np.stack([rows, np.concatenate(arrays) if arrays else rows])
