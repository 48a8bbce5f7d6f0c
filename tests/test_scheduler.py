"""Admission: a newcomer needs its own sequence and tree, beside the next tree of every running
request, so admitting it never turns the running batch's steps plain."""

from specflow.request import Request
from specflow.runtime.kv_cache import PagedKVCache
from specflow.sampling import SamplingParams
from specflow.scheduler import Scheduler

N = 5  # tree nodes


def request(rid: int, length: int) -> Request:
    return Request(rid, list(range(1, length + 1)), SamplingParams(), eos_token_ids=[0])


def test_a_newcomer_leaves_the_running_requests_their_next_trees():
    for pages, admitted in ((9 + N + 10 + N - 1, False), (9 + N + 10 + N, True)):
        scheduler = Scheduler(PagedKVCache(1, 1, 8, num_pages=pages), max_batch_size=4, num_draft_tokens=N)
        running = request(0, 10)
        scheduler.add(running)
        assert scheduler.admit() == [running]             # alone: its sequence and one token
        scheduler.cache.reserve([0], [9])                 # its prefill: all but the root
        scheduler.add(request(1, 10))
        # running: 9 cached + its tree of N -> N more pages; the newcomer: 10 + N
        assert bool(scheduler.admit()) == admitted, pages


def test_one_step_prefills_at_most_max_prefill_tokens():
    scheduler = Scheduler(PagedKVCache(1, 1, 8, num_pages=1000), max_batch_size=8, num_draft_tokens=N,
                          max_prefill_tokens=20)
    short = [request(i, 10) for i in range(3)]   # 10 prompt tokens to prefill each
    long = request(3, 50)
    for r in [*short, long]:
        scheduler.add(r)
    assert scheduler.admit() == short[:2]
    assert scheduler.admit() == short[2:]        # the long prompt would pass the bound beside it
    assert scheduler.admit() == [long]           # alone it runs, past the bound
