"""The engine thread's streaming bookkeeping, without a server."""

import asyncio

import pytest

from specflow.engine import SpecEngine
from specflow.request import RequestOutput
from specflow.sampling import SamplingParams
from specflow.serve.engine_loop import Delta, EngineLoop, Submission, _Stream
from specflow.serve.metrics import Metrics


def test_text_held_back_for_a_long_stop_string_is_sent_once_in_order():
    """While a stop string could still complete, its length - 1 trailing characters wait; a stop
    string longer than the text so far holds back all of it (and nothing is sent twice)."""
    texts = ["ab", "abcdefgh", "abcdefghijklmn", "abcdefghijklmnopqrstu", "abcdefghijklmnopqrstuvw"]

    async def publish() -> list[str]:
        loop = EngineLoop(engine=None, metrics=Metrics(max_accept_length=8, num_kv_pages=1))
        sub = Submission([([1], SamplingParams(stop=["0123456789"]))])
        loop._streams[0] = _Stream(sub, index=0, hold=9)
        for i, text in enumerate(texts):
            out = RequestOutput(0, [1], list(range(i + 1)), text, "length", [1] * (i + 1))
            loop._publish(out, done=i == len(texts) - 1)
        await asyncio.sleep(0)  # the deltas are put on the submission's queue by its event loop
        return [sub.deltas.get_nowait().text for _ in range(sub.deltas.qsize())]

    pieces = asyncio.run(publish())
    assert pieces == ["", "", "abcde", "fghijkl", "mnopqrstuvw"]  # (texts 14, 21 chars; hold 9)


def test_kv_pages_used_counts_requests_not_the_graphs_padding_nor_the_prefix_cache(tiny_target):
    """An idle engine reports 0 pages used: the CUDA graphs' padding page and cached pages no
    request holds are not anybody's."""
    engine = SpecEngine(tiny_target, device="cpu", dtype="float32", cuda_graphs=True, prefix_caching=True)
    engine.generate([[5, 6, 7, 8, 9]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    loop = EngineLoop(engine=engine, metrics=Metrics(max_accept_length=8, num_kv_pages=1))
    loop._update_gauges()
    assert engine.runner.cache.num_pages_used > 0
    assert loop.metrics.kv_pages_used._value.get() == 0 and loop.metrics.kv_pages_cached._value.get() > 0


def test_a_failed_step_answers_every_request_before_it_aborts_them():
    """The requests of a failed step were aborted before their 'error' deltas were sent: an abort
    that raised too (the same broken component releasing them) left every client waiting for good.
    Each gets its delta first, counted as finished with reason 'error'."""

    class BrokenEngine:
        def step(self):
            raise RuntimeError("drafter bug")

        def abort(self, request_id):
            raise RuntimeError("drafter bug, again")

    async def fail() -> list[str | None]:
        loop = EngineLoop(engine=BrokenEngine(), metrics=Metrics(max_accept_length=8, num_kv_pages=1))
        subs = [Submission([([1], SamplingParams())]) for _ in range(2)]
        for rid, sub in enumerate(subs):
            loop._streams[rid] = _Stream(sub, index=0, hold=0)
        try:
            loop._step()
        except RuntimeError:
            pass   # (the abort's: the engine thread stops, as before; /health then says so)
        await asyncio.sleep(0)
        assert loop.metrics.finished.labels("error")._value.get() == 2
        return [sub.deltas.get_nowait().finish_reason for sub in subs]

    assert asyncio.run(fail()) == ["error", "error"]


def test_a_running_stream_gets_each_step_s_tokens_as_they_come(tiny_target):
    """Running streams are published from snapshots of what they gained since the last delta:
    a delta every step with new tokens, their logprobs and accept lengths, adding up to the
    finished output (not everything held until the end)."""
    engine = SpecEngine(tiny_target, {"type": "ngram"}, {"type": "chain", "depth": 3}, {"type": "greedy"},
                        device="cpu", dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)

    async def stream() -> tuple[list[Delta], Metrics]:
        loop = EngineLoop(engine=engine, metrics=Metrics(max_accept_length=8, num_kv_pages=1))
        sub = Submission([([5, 6, 7, 5, 6, 7, 5, 6], params)])
        loop._add(sub)
        while engine.has_unfinished():
            loop._step()
        await asyncio.sleep(0)
        return [sub.deltas.get_nowait() for _ in range(sub.deltas.qsize())], loop.metrics

    deltas, metrics = asyncio.run(stream())
    final = deltas[-1].output
    assert len(deltas) > 2 and all(d.token_ids for d in deltas[:-1])
    assert [t for d in deltas for t in d.token_ids] == final.token_ids
    assert [lp for d in deltas for lp in d.logprobs] == final.logprobs
    assert metrics.accept_length._sum.get() == sum(final.accept_lengths)


def test_a_stream_holds_back_one_character_fewer_than_its_longest_stop_string(tiny_target):
    """A stop string not yet complete has at most its length - 1 characters in the text: a
    running stream sends all but that many of the longest one's (not one more)."""
    engine = SpecEngine(tiny_target, device="cpu", dtype="float32")

    async def publish() -> list[str]:
        loop = EngineLoop(engine=engine, metrics=Metrics(max_accept_length=8, num_kv_pages=1))
        sub = Submission([([5, 6, 7], SamplingParams(stop=["xy", "0123456789"]))])
        loop._add(sub)
        rid = sub.request_ids[0]
        for i, text in enumerate(["abcdefghijkl", "abcdefghijklmn"]):
            loop._publish(RequestOutput(rid, [5, 6, 7], list(range(i + 1)), text, None, [1] * (i + 1)), done=False)
        loop._abort(sub.request_ids)
        await asyncio.sleep(0)
        return [sub.deltas.get_nowait().text for _ in range(sub.deltas.qsize())]

    assert asyncio.run(publish()) == ["abc", "de"]   # 12 and 14 characters, 9 held back


def test_a_submission_the_engine_refuses_in_part_leaves_none_of_its_requests_behind(tiny_target):
    """All or none: when one choice's request is refused, the choices added before it are taken
    out of the engine again (they would run with nobody to read them)."""
    engine = SpecEngine(tiny_target, device="cpu", dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    async def add() -> Submission:
        loop = EngineLoop(engine=engine, metrics=Metrics(max_accept_length=8, num_kv_pages=1))
        sub = Submission([([5, 6, 7], params), ([], params)])   # the second: an empty prompt
        loop._add(sub)
        assert not loop._streams
        return sub

    sub = asyncio.run(add())
    with pytest.raises(ValueError, match="empty"):
        sub.added.result()
    assert len(sub.request_ids) == 1 and not engine.has_unfinished()


def test_the_running_gauge_counts_a_request_prefilled_in_chunks(tiny_target):
    """A request whose prompt is prefilled in chunks holds pages and takes steps: the running
    gauge counts it from its first chunk, not only once it joins the decoding batch."""
    engine = SpecEngine(tiny_target, device="cpu", dtype="float32", max_prefill_tokens=8)
    loop = EngineLoop(engine=engine, metrics=Metrics(max_accept_length=8, num_kv_pages=1))
    rid = engine.add_request(list(range(1, 30)), SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    engine.step()
    assert engine.scheduler.prefilling is not None and not engine.scheduler.running
    loop._update_gauges()
    assert loop.metrics.running._value.get() == 1 and loop.metrics.queue_length._value.get() == 0
    engine.abort(rid)
