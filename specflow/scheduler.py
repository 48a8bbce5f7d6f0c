"""Continuous batching: which requests run this step, admission by free KV pages, preemption."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from specflow.request import Request, Status
from specflow.runtime.cuda_graph import PAD_REQUEST
from specflow.runtime.kv_cache import PagedKVCache


# SGLang's in-batch prefix caching: a waiting request that shares more than this many tokens past
# its cached prefix with a prompt this step prefills waits a step, to read that prompt's pages
SHARED_PREFIX_WAIT = 32


@dataclass
class Chunk:
    """The tokens ``start .. end - 1`` of a request's prefill input (``Request.prefill_ids``)
    that one step sends; the last chunk ends the prefill."""

    req: Request
    start: int
    end: int
    first: bool  # the request was admitted this step (start is 0 or its cached prefix)

    @property
    def last(self) -> bool:
        return self.end == self.req.prefill_len


class Scheduler:
    """Requests wait in FIFO order and run while the batch and the KV pool have room.

    A request is admitted when the pool can hold its sequence plus one tree of ``num_draft_tokens``
    nodes (plus one token when nothing runs: a step without room for trees verifies the roots
    only), next to the next tree of every running request: a newcomer never takes the room the
    running batch speculates in (vLLM's lookahead slots), which would turn every step plain. When
    even a plain step runs out of pages, the newest running request is preempted: its KV is freed
    and it goes back to the front of the queue, to be recomputed from its tokens later.

    One step prefills at most ``max_prefill_tokens`` tokens (SGLang's ``chunked_prefill_size``),
    so that long prompts neither stall the running requests' steps for one huge forward nor need
    their activations at once: a prompt longer than what is left of the bound is prefilled in
    chunks over the next steps (one such request at a time, ``prefilling``), and joins the
    running batch with its last chunk. It is admitted, as any request, when the pool can hold its
    whole sequence and tree; it is the first to be preempted (its chunks done so far dropped).

    With prefix caching (PagedKVCache.prefix), an admitted request starts with the cached pages
    of its longest cached prefix and prefills the rest only; one that shares a longer prefix with
    a prompt prefilled in the same step waits for that prompt's pages (a burst of requests with
    one system prompt, the ``n`` choices of one prompt: one of them computes it).
    """

    def __init__(self, cache: PagedKVCache, max_batch_size: int, num_draft_tokens: int,
                 max_prefill_tokens: int | None = None):
        self.cache = cache
        self.max_batch_size = max_batch_size
        self.num_draft_tokens = num_draft_tokens
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.prefilling: Request | None = None  # admitted, prefilled in chunks: not running yet
        # the queue head the pool could not hold: (it, the pages it matched, prefix.num_inserted then)
        self._waiting_match: tuple[Request, int, int] | None = None

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running) or self.prefilling is not None

    def admit(self) -> list[Chunk]:
        """This step's prefill: the next chunk of the request being prefilled in chunks, then
        waiting requests that fit, in FIFO order. A request whose last chunk is in it joins the
        running batch."""
        chunks: list[Chunk] = []
        n, budget = self.num_draft_tokens, self.max_prefill_tokens or float("inf")
        ids = [r.id for r in self.running]
        lens = [r.seq_len - 1 + n for r in self.running]  # K/V of all but the root, then a tree from it
        if self.prefilling is not None:  # (its pages were counted at its admission)
            req = self.prefilling
            chunks.append(Chunk(req, req.prefilled, int(min(req.prefill_len, req.prefilled + budget)), False))
            budget -= chunks[-1].end - chunks[-1].start
            ids.append(req.id)
            lens.append(req.seq_len + n)
            if chunks[-1].last:
                self.prefilling = None
        while self.waiting and budget > 0 and len(ids) < self.max_batch_size:
            head = self.waiting[0]
            ids.append(head.id)
            lens.append(head.seq_len + (n if len(ids) > 1 else 1))
            # its cached prefix (not with prompt logprobs: they need every prompt token's logits),
            # all but the last token, whose logits sample the first; not looked up again for a
            # head that did not fit and could not now were its match longer by every page cached
            # since (a long prefix takes milliseconds to match, and a waiting head every step)
            if self.cache.prefix is not None and head.prompt_logprobs is None:
                if not self.cache.fits(ids, lens, cached=self._most_cached(head)):
                    break
                head.prefilled = self.cache.match(head.id, head.prefill_ids[:head.prefill_len - 1])
                if any(self._sharable(head, c.req) - head.prefilled > SHARED_PREFIX_WAIT for c in chunks):
                    self._unmatch(head)
                    break
            if not self.cache.fits(ids, lens):
                if self.cache.prefix is not None:
                    self._waiting_match = (head, head.prefilled // self.cache.page_size, self.cache.prefix.num_inserted)
                self._unmatch(head)
                break
            req = self.waiting.popleft()
            req.status = Status.RUNNING
            self._waiting_match = None  # (its prefill grows once it runs: a later wait matches afresh)
            chunks.append(Chunk(req, req.prefilled, int(min(req.prefill_len, req.prefilled + budget)), True))
            budget -= chunks[-1].end - chunks[-1].start
            if not chunks[-1].last:  # (the bound is spent: one request at a time is prefilled in chunks)
                self.prefilling = req
        self.running += [c.req for c in chunks if c.last]
        return chunks

    def preempt(self) -> Request:
        """Take the request being prefilled in chunks, else the newest running one, back to the
        front of the queue (its K/V is the caller's to free)."""
        if self.prefilling is not None:
            req, self.prefilling = self.prefilling, None
        else:
            req = self.running.pop()
        req.status = Status.WAITING
        req.prefilled = 0
        self.waiting.appendleft(req)
        return req

    def requeue(self, chunks: list[Chunk]) -> None:
        """Undo an admission whose prefill found no pages: requests admitted this step go back to
        the front of the queue, in order, letting go of their cached prefixes; the one prefilled
        in chunks keeps its place and its chunks."""
        for chunk in reversed(chunks):
            req = chunk.req
            if not chunk.first:  # a later chunk: the request stays being prefilled
                self.prefilling = req
                self.running = [r for r in self.running if r is not req]
                continue
            if req is self.prefilling:
                self.prefilling = None
            else:
                self.running.remove(req)
            self._unmatch(req)
            req.status = Status.WAITING
            self.waiting.appendleft(req)

    def _sharable(self, head: Request, other: Request) -> int:
        """The tokens of ``head``'s prefill that ``other``'s pages will hold once it is prefilled:
        the full pages of their common prefix that ``other`` caches (of its prefill input) and
        ``head`` can match (all but its last token)."""
        common = min(common_prefix(head.prefill_ids, other.prefill_ids), other.prefill_len, head.prefill_len - 1)
        return common // self.cache.page_size * self.cache.page_size

    def _most_cached(self, head: Request) -> int:
        """The most pages ``head``'s match can hold: its last match's (when it did not fit) and
        every page cached since, else its whole prefill but the last token."""
        if self._waiting_match is not None and self._waiting_match[0] is head:
            _, pages, inserted = self._waiting_match
            return pages + self.cache.prefix.num_inserted - inserted
        return (head.prefill_len - 1) // self.cache.page_size

    def _unmatch(self, req: Request) -> None:
        """Let go of the cached prefix a request not admitted took."""
        if req.prefilled:
            self.cache.release(req.id)
            req.prefilled = 0

    def finish(self, req: Request) -> None:
        if req is self.prefilling:
            self.prefilling = None
        elif req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = Status.FINISHED

    def fits_alone(self, req: Request) -> bool:
        """Whether the whole pool could ever hold this request's next step, a plain one at least."""
        return req.seq_len + 1 <= self.max_request_tokens()

    def max_request_tokens(self) -> int:
        """The most tokens one request can hold: the whole pool but the CUDA graphs' padding pages."""
        usable = self.cache.allocator.num_pages - len(self.cache.block_tables.get(PAD_REQUEST, ()))
        return usable * self.cache.page_size


def common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    differs = np.asarray(a[:n]) != np.asarray(b[:n])
    return int(differs.argmax()) if differs.any() else n
