"""The engine thread: one SpecEngine serves every HTTP request with continuous batching.

The engine is synchronous and single-threaded, so one thread owns it. HTTP handlers talk to it
through a command queue (add, abort, stop) that the thread drains between steps; after each step
it sends every request's new tokens and text to the handler's asyncio queue. Requests therefore
join and leave the running batch between steps, and an abort frees KV pages before the next step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass

from specflow.engine import SpecEngine
from specflow.logprobs import TokenLogprob
from specflow.request import RequestOutput
from specflow.runtime.cuda_graph import PAD_REQUEST
from specflow.sampling import SamplingParams
from specflow.serve.metrics import Metrics

log = logging.getLogger("specflow.serve")


@dataclass(slots=True)
class Delta:
    """What one choice gained since its previous delta. Its last delta has ``finish_reason`` set
    (``stop``, ``length``, ``abort`` when the server cancelled it at shutdown, or ``error`` when
    the engine failed) and, but for ``error``, carries the whole output."""

    index: int                                # the choice within its HTTP request
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None = None
    output: RequestOutput | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None   # on a choice's first delta, when recorded


class Submission:
    """The engine requests behind one HTTP request (one per choice) and the queue of their deltas.

    Create it on the event loop; the engine thread fills ``request_ids`` and resolves ``added``.
    """

    def __init__(self, choices: list[tuple[list[int], SamplingParams]]):
        self.choices = choices
        self.loop = asyncio.get_running_loop()
        self.deltas: asyncio.Queue[Delta] = asyncio.Queue()
        self.request_ids: list[int] = []
        self.added: concurrent.futures.Future[None] = concurrent.futures.Future()


@dataclass
class _Stream:
    """Engine-thread bookkeeping of one engine request: how much of its output was sent."""

    sub: Submission
    index: int
    hold: int                  # characters held back while a stop string may still complete
    sent_tokens: int = 0
    sent_chars: int = 0
    seen_steps: int = 0


class EngineNotRunning(RuntimeError):
    """The engine thread has stopped (shutdown, or a crash that the server log shows)."""


class EngineLoop:
    """Runs ``engine`` on a thread of its own; thread-safe ``submit`` / ``abort`` / ``stop``."""

    def __init__(self, engine: SpecEngine, metrics: Metrics):
        self.engine = engine
        self.metrics = metrics
        self._commands: queue.SimpleQueue[tuple[str, Submission | None]] = queue.SimpleQueue()
        self._streams: dict[int, _Stream] = {}      # engine request id -> stream (engine thread only)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="specflow-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    @property
    def in_flight(self) -> int:
        """Engine requests not yet finished (waiting or running)."""
        return len(self._streams)

    async def submit(self, choices: list[tuple[list[int], SamplingParams]]) -> Submission:
        """Add one engine request per choice, all or none: a prompt the engine refuses (too long
        for the context or the KV cache) raises its ValueError here, before anything runs."""
        if not self.alive:
            raise EngineNotRunning("the engine is not running (shutting down, or failed: see the server log)")
        sub = Submission(choices)
        self._commands.put(("add", sub))
        try:
            await asyncio.wrap_future(sub.added)
        except asyncio.CancelledError:
            self.abort(sub)   # queued after the add, so it finds the requests the add made
            raise
        return sub

    def abort(self, sub: Submission) -> None:
        """Cancel the submission's unfinished requests; their KV pages are freed before the next step."""
        self._commands.put(("abort", sub))

    def cancel_all(self) -> None:
        """End every unfinished request now with what it has, ``finish_reason="abort"``."""
        self._commands.put(("cancel", None))

    def stop(self) -> None:
        """Cancel whatever is still running and join the thread."""
        self._stopping = True
        self._commands.put(("stop", None))
        self._thread.join()

    # ----------------------------------------------------------------------------------------
    # the engine thread

    def _run(self) -> None:
        running = True
        while running:
            # block while idle; otherwise take whatever arrived during the last step
            commands = [] if self.engine.has_unfinished() else [self._commands.get()]
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            for kind, sub in commands:
                if kind == "add":
                    self._add(sub)
                elif kind == "abort":
                    self._abort(sub.request_ids)
                elif kind == "cancel":
                    self._cancel_all()
                else:
                    running = False
            if running and self.engine.has_unfinished():
                self._step()
            self._update_gauges()
        log.info("engine loop stopped; %d requests still unfinished were cancelled", len(self._streams))
        self._abort(list(self._streams))
        self._update_gauges()

    def _add(self, sub: Submission) -> None:
        if not sub.added.set_running_or_notify_cancel():
            return  # the handler went away before its turn
        try:
            for prompt, params in sub.choices:
                sub.request_ids.append(self.engine.add_request(prompt, params))
        except Exception as e:  # a ValueError: the request's fault (a 400); else the engine's, and it carries on
            if not isinstance(e, ValueError):
                log.exception("adding a request failed")
            self._abort_engine(sub.request_ids)
            sub.added.set_exception(e)
            return
        for index, ((prompt, params), rid) in enumerate(zip(sub.choices, sub.request_ids)):
            hold = max(map(len, params.stop)) - 1 if params.stop else 0
            self._streams[rid] = _Stream(sub, index, hold)
            self.metrics.prompt_tokens.inc(len(prompt))
        sub.added.set_result(None)

    def _abort(self, request_ids: list[int]) -> None:
        for rid in request_ids:
            if self._streams.pop(rid, None) is not None:
                self.engine.abort(rid)
                self.metrics.finished.labels("abort").inc()

    def _cancel_all(self) -> None:
        for out in self.engine.snapshot(list(self._streams)):
            self.engine.abort(out.request_id)
            out.finish_reason = "abort"
            self._publish(out, done=True)

    def _abort_engine(self, request_ids: list[int]) -> None:
        for rid in request_ids:
            self.engine.abort(rid)

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            finished = self.engine.step()
        except Exception:  # a component failed: fail the requests in flight, keep serving new ones
            log.exception("engine step failed; ending the requests in flight with finish_reason 'error'")
            failed, self._streams = self._streams, {}
            for st in failed.values():   # (answered before the aborts, which the same component may fail)
                self._send(st, Delta(st.index, "", [], None, "error"))
                self.metrics.finished.labels("error").inc()
            self._abort_engine(list(failed))
            return
        self.metrics.step_seconds.observe(time.perf_counter() - t0)
        for out in finished:
            self._publish(out, done=True)
        # running streams: only what each gained (a whole-output copy per stream and step grew
        # with the square of the output's length)
        seen = {rid: (st.sent_tokens, st.seen_steps) for rid, st in self._streams.items()}
        for out in self.engine.snapshot(list(seen), since=seen):
            self._publish(out, done=False, since=seen[out.request_id])

    def _publish(self, out: RequestOutput, done: bool, since: tuple[int, int] = (0, 0)) -> None:
        """Send what ``out`` gained since the last delta; ``out`` lists what came after ``since``
        (tokens, steps: ``SpecEngine.snapshot``). While a request runs, text that a stop string
        might still cut, and a trailing incomplete UTF-8 character, are held back."""
        st = self._streams.pop(out.request_id) if done else self._streams[out.request_id]
        tokens, steps = st.sent_tokens - since[0], st.seen_steps - since[1]  # unsent, within out's lists
        new_ids = out.token_ids[tokens:]
        if not new_ids and not done:
            return
        text = out.text or ""
        end = len(text) if done else max(st.sent_chars, len(text.rstrip("\ufffd")) - st.hold)
        piece = text[st.sent_chars:end]
        st.sent_chars = end
        logprobs = None if out.logprobs is None else out.logprobs[tokens:]
        prompt_logprobs = out.prompt_logprobs if st.sent_tokens == 0 else None
        for accept_length in out.accept_lengths[steps:]:
            self.metrics.accept_length.observe(accept_length)
        self.metrics.generation_tokens.inc(len(new_ids))
        st.sent_tokens, st.seen_steps = since[0] + len(out.token_ids), since[1] + len(out.accept_lengths)
        if done:
            self.metrics.finished.labels(out.finish_reason).inc()
            self.metrics.cached_prompt_tokens.inc(out.num_cached_tokens)
        self._send(st, Delta(st.index, piece, new_ids, logprobs, out.finish_reason if done else None,
                             out if done else None, prompt_logprobs))

    @staticmethod
    def _send(st: _Stream, delta: Delta) -> None:
        st.sub.loop.call_soon_threadsafe(st.sub.deltas.put_nowait, delta)

    def _update_gauges(self) -> None:
        self.metrics.queue_length.set(len(self.engine.scheduler.waiting))
        self.metrics.running.set(len(self.engine.scheduler.running) + (self.engine.scheduler.prefilling is not None))
        cache = self.engine.runner.cache
        padding = len(cache.block_tables.get(PAD_REQUEST, ()))  # (the CUDA graphs' padding page)
        self.metrics.kv_pages_used.set(cache.allocator.num_pages - cache.num_available - padding)
        self.metrics.kv_pages_cached.set(cache.prefix.num_cached if cache.prefix else 0)
