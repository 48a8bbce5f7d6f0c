"""Continuous batching: which requests run this step, admission by free KV pages, preemption."""

from __future__ import annotations

from collections import deque

from specflow.request import Request, Status
from specflow.runtime.cuda_graph import PAD_REQUEST
from specflow.runtime.kv_cache import PagedKVCache


class Scheduler:
    """Requests wait in FIFO order and run while the batch and the KV pool have room.

    A request is admitted when the pool can hold its sequence plus one tree of ``num_draft_tokens``
    nodes (plus one token when nothing runs: a step without room for trees verifies the roots
    only), next to the next tree of every running request: a newcomer never takes the room the
    running batch speculates in (vLLM's lookahead slots), which would turn every step plain. When
    even a plain step runs out of pages, the newest running request is preempted: its KV is freed
    and it goes back to the front of the queue, to be recomputed from its tokens later.

    One step prefills at most ``max_prefill_tokens`` tokens (SGLang's ``max_prefill_tokens``; a
    longer prompt alone), so that a burst of long prompts neither stalls the running requests'
    steps for one huge forward nor needs its activations at once.
    """

    def __init__(self, cache: PagedKVCache, max_batch_size: int, num_draft_tokens: int,
                 max_prefill_tokens: int | None = None):
        self.cache = cache
        self.max_batch_size = max_batch_size
        self.num_draft_tokens = num_draft_tokens
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self) -> list[Request]:
        """Move waiting requests that fit into the running batch; returns them (to be prefilled)."""
        admitted = []
        n = self.num_draft_tokens
        ids = [r.id for r in self.running]
        lens = [r.seq_len - 1 + n for r in self.running]  # K/V of all but the root, then a tree from it
        prefill = 0  # tokens this step prefills, each sequence counted whole (a resumed one's root is not sent)
        while self.waiting and len(self.running) + len(admitted) < self.max_batch_size:
            head = self.waiting[0]
            lookahead = n if self.running or admitted else 1
            prefill += head.seq_len
            if admitted and self.max_prefill_tokens is not None and prefill > self.max_prefill_tokens:
                break
            if not self.cache.fits(ids + [head.id], lens + [head.seq_len + lookahead]):
                break
            ids.append(head.id)
            lens.append(head.seq_len + lookahead)
            req = self.waiting.popleft()
            req.status = Status.RUNNING
            admitted.append(req)
        self.running.extend(admitted)
        return admitted

    def preempt(self) -> Request:
        """Take the newest running request back to the front of the queue."""
        req = self.running.pop()
        req.status = Status.WAITING
        self.waiting.appendleft(req)
        return req

    def requeue(self, reqs: list[Request]) -> None:
        """Send just-admitted requests back to the front of the queue, in order."""
        for req in reversed(reqs):
            self.running.remove(req)
            req.status = Status.WAITING
            self.waiting.appendleft(req)

    def finish(self, req: Request) -> None:
        if req in self.running:
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
