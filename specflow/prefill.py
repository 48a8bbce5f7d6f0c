"""Prefill: the K/V of each admitted request's prompt, in chunks the scheduler bounds per step;
then its first token and its drafter's begin."""

from __future__ import annotations

from typing import TYPE_CHECKING

from specflow.logprobs import add_prompt_logprobs, add_token_logprobs
from specflow.request import RequestOutput
from specflow.runtime.kv_cache import OutOfPages
from specflow.sampling import next_tokens
from specflow.scheduler import Chunk

if TYPE_CHECKING:
    from specflow.engine import SpecEngine


class Prefill:
    """The engine's prefill steps; the engine's scheduler, runner, pipeline, sampling, penalties
    and request lifecycle are its engine's."""

    def __init__(self, engine: SpecEngine):
        self.engine = engine

    def step(self, chunks: list[Chunk]) -> list[RequestOutput]:
        """Compute the K/V of this step's chunks of each admitted request's prefill input (a new
        request's prompt; a resumed one's sequence but its root).

        A request whose last chunk is among them is ready: a new one samples its first token from
        the prompt's last logits (a resumed one already has it), and the drafter begins it with
        the target features of its whole input (those of earlier chunks held until then).
        """
        if not chunks:
            return []
        engine = self.engine
        reqs = [c.req for c in chunks]
        needs = engine.drafter.needs if engine.drafter is not None else None
        try:
            out = engine.runner.extend([r.id for r in reqs], [r.prefill_ids[c.start:c.end] for r, c in zip(reqs, chunks)],
                                       logits="last", taps=needs.layer_taps if needs else ())
        except OutOfPages:
            engine.scheduler.requeue(chunks)
            return []
        if engine._feed is not None:
            engine._feed.prefilled(chunks, out)
        fresh = [not r.output_ids for r in reqs]
        add_prompt_logprobs(engine.model, [(b, c.req, c.start, c.last) for b, c in enumerate(chunks)
                                         if fresh[b] and c.req.prompt_logprobs is not None], out)
        for c in chunks:
            c.req.prefilled = c.end
            if c.first and not c.req.output_ids and not c.req.prefill_began:  # (once: not after a preemption)
                c.req.num_cached_tokens, c.req.prefill_began = c.start, True
            if c.last and engine.runner.cache.prefix is not None:
                engine.runner.cache.insert(c.req.id, c.req.prefill_ids)
        rows = [b for b, c in enumerate(chunks) if c.last and fresh[b]]  # (a resumed request's generator draws nothing)
        logits = out.logits if len(rows) == len(reqs) else out.logits[rows]
        drawing = [reqs[b] for b in rows]
        first = next_tokens(engine._adjusted(logits, engine._penalties(drawing)), engine._sampling(drawing))
        first = dict(zip(rows, first.tolist()))
        live, logprobs = [], []
        for b, req in enumerate(reqs):
            if b in first:
                req.append([first[b]])
                if req.logprobs is not None:
                    logprobs.append((req, [b], [first[b]]))
            if chunks[b].last and not req.finished:
                live.append((b, req))
        add_token_logprobs(out.logits, logprobs)
        finished = [engine._finish(req) for req in reqs if req.finished]
        if engine.drafter is not None and live:
            engine._drafting.update(req.id for _, req in live)
            engine.drafter.begin(engine._feed.layout(
                [req for _, req in live], [list(range(out.offsets[b], out.offsets[b + 1])) for b, _ in live],
                out, [req.prefill_len + 1 for _, req in live], begin=True))
        return finished
