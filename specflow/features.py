"""What flows from the target into a drafter (``TargetFeatures``): the committed tokens of each
request with the target's hidden states and layer taps where the drafter reads them, laid out for
``Drafter.begin`` after a prefill and ``Drafter.commit`` after a step."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from specflow.protocols import TargetFeatures, TargetNeeds
from specflow.request import Request
from specflow.runtime.feature_cache import FeatureCache
from specflow.runtime.kv_cache import PagedKVCache
from specflow.runtime.model_runner import ExtendOutput
from specflow.runtime.transfer import to_device
from specflow.scheduler import Chunk

Pieces = list[tuple[Tensor | None, Tensor | None]]  # (hidden, taps) of consecutive tokens


class FeatureFeed:
    """A drafter's target features. A prompt prefilled in chunks reaches ``Drafter.begin`` whole,
    with its last chunk: the features of the earlier ones are held until then. With prefix
    caching, the features of every token in the target's KV cache are kept beside it
    (FeatureCache), so a request whose prefix is cached gives its drafter those it did not
    compute."""

    def __init__(self, needs: TargetNeeds, cache: PagedKVCache, hidden_size: int, dtype: torch.dtype):
        self.needs = needs
        self.reads = needs.last_hidden or bool(needs.layer_taps)   # hidden states or taps at all
        self.held: dict[int, Pieces] = {}
        self.cache = None
        if cache.prefix is not None and self.reads:
            self.cache = FeatureCache(cache, (hidden_size if needs.last_hidden else None,
                                              len(needs.layer_taps) * hidden_size or None), dtype)

    def rows(self, out: ExtendOutput, rows: Tensor | slice) -> tuple[Tensor | None, Tensor | None]:
        """The features of ``rows`` of ``out``: hidden [n, H] and taps [n, len(layer_taps) * H],
        each None where the drafter does not read it."""
        hidden = out.hidden[rows] if self.needs.last_hidden else None
        taps = torch.cat([t[rows] for t in out.taps], -1) if self.needs.layer_taps else None
        return hidden, taps

    def prefilled(self, chunks: list[Chunk], out: ExtendOutput) -> None:
        """After a prefill forward over ``chunks``: hold the features of chunks that do not end
        their prompt (and of a cached prefix, as its request's first chunk comes), cache them all."""
        if not self.reads:
            return
        if self.cache is not None:
            self.cache.write([c.req.id for c in chunks], [c.start for c in chunks], [c.end - c.start for c in chunks],
                             self.rows(out, slice(None)))
        for b, c in enumerate(chunks):
            if c.first and c.start and self.cache is not None:
                self.held[c.req.id] = [self.cache.read(c.req.id, c.start)]
            if not c.last:
                self.held.setdefault(c.req.id, []).append(self.rows(out, slice(*out.offsets[b:b + 2])))

    def committed(self, reqs: list[Request], bases: list[int], rows: list[list[int]], out: ExtendOutput) -> None:
        """After a step's commit (a plain step's launch: its roots, whose K/V it writes): cache the
        features of each request's committed tokens (flat ``rows`` of ``out``) where their K/V now
        lie (logical indices ``base ..``)."""
        if self.cache is None:
            return
        self.cache.write([r.id for r in reqs], bases, [len(rw) for rw in rows], self.rows(out, _flat(rows, out)))

    def release(self, request_id: int) -> None:
        self.held.pop(request_id, None)

    def layout(self, reqs: list[Request], rows: list[list[int]], out: ExtendOutput, num_new: list[int],
               begin: bool = False) -> TargetFeatures:
        """Target features of the committed tokens ``rows`` (flat rows of ``out``) of each request,
        after those held for it when ``begin``; the tokens are the last ``num_new`` of the
        sequence minus the newest (the next root)."""
        lens = [n - 1 for n in num_new]
        tokens = torch.from_numpy(np.concatenate([np.array(req.seq[-n:-1], dtype=np.int64)  # (no per-token loop:
                                                  for req, n in zip(reqs, num_new)]))         # prompts are long)
        positions = torch.from_numpy(np.concatenate([np.arange(req.seq_len - n, req.seq_len - 1)
                                                     for req, n in zip(reqs, num_new)]))
        hidden = taps = None
        if self.reads:  # (one gather each)
            hidden, taps = (None if x is None else list(x.split([len(rw) for rw in rows]))
                            for x in self.rows(out, _flat(rows, out)))
        for i, req in enumerate(reqs):
            pieces = self.held.pop(req.id, []) if begin else []
            for k, x in enumerate((hidden, taps)):
                if pieces and x is not None:
                    x[i] = torch.cat([*(p[k] for p in pieces), x[i]])
        return TargetFeatures(
            request_ids=[r.id for r in reqs], tokens=list(tokens.split(lens)), positions=list(positions.split(lens)),
            next_tokens=[r.seq[-1] for r in reqs], hidden=hidden, taps=taps, contexts=[r.seq for r in reqs])


def _flat(rows: list[list[int]], out: ExtendOutput) -> Tensor:
    """[sum of lengths] int64 on ``out``'s device: the flat rows of ``out`` of every request."""
    flat = torch.from_numpy(np.fromiter((i for rw in rows for i in rw), dtype=np.int64))
    return to_device([flat], out.hidden.device)[0]
