"""Admission: a newcomer needs its own sequence and tree, beside the next tree of every running
request, so admitting it never turns the running batch's steps plain."""

from specflow.request import Request
from specflow.runtime.kv_cache import PagedKVCache
from specflow.sampling import SamplingParams
from specflow.scheduler import SHARED_PREFIX_WAIT, Scheduler

N = 5  # tree nodes


def request(rid: int, length: int) -> Request:
    return Request(rid, list(range(1, length + 1)), SamplingParams(), eos_token_ids=[0])


def test_a_newcomer_leaves_the_running_requests_their_next_trees():
    for pages, admitted in ((9 + N + 10 + N - 1, False), (9 + N + 10 + N, True)):
        scheduler = Scheduler(PagedKVCache(1, 1, 8, num_pages=pages), max_batch_size=4, num_draft_tokens=N)
        running = request(0, 10)
        scheduler.add(running)
        assert admitted_requests(scheduler) == [running]  # alone: its sequence and one token
        scheduler.cache.reserve([0], [9])                 # its prefill: all but the root
        scheduler.add(request(1, 10))
        # running: 9 cached + its tree of N -> N more pages; the newcomer: 10 + N
        assert bool(admitted_requests(scheduler)) == admitted, pages


def admitted_requests(scheduler: Scheduler) -> list[Request]:
    chunks = scheduler.admit()
    assert all(c.start == 0 and c.last for c in chunks)
    return [c.req for c in chunks]


def test_one_step_prefills_at_most_max_prefill_tokens_and_chunks_the_rest():
    scheduler = Scheduler(PagedKVCache(1, 1, 8, num_pages=1000), max_batch_size=8, num_draft_tokens=N,
                          max_prefill_tokens=20)
    short = [request(i, 10) for i in range(3)]   # 10 prompt tokens to prefill each
    long = request(3, 45)
    for r in [*short, long]:
        scheduler.add(r)

    def admit():
        return [(c.req.id, c.start, c.end, c.last) for c in scheduler.admit()]

    assert admit() == [(0, 0, 10, True), (1, 0, 10, True)]
    assert admit() == [(2, 0, 10, True), (3, 0, 10, False)]
    assert scheduler.prefilling is long and long not in scheduler.running
    long.prefilled = 10                           # (the engine's, after the chunk's forward)
    scheduler.add(request(4, 3))
    assert admit() == [(3, 10, 30, False)]       # the bound is spent: nobody else is admitted
    long.prefilled = 30
    assert admit() == [(3, 30, 45, True), (4, 0, 3, True)]  # 15 + 3
    assert scheduler.prefilling is None and scheduler.running[-2:] == [long, scheduler.running[-1]]


def test_the_request_prefilled_in_chunks_is_preempted_first_and_starts_over():
    scheduler = Scheduler(PagedKVCache(1, 1, 8, num_pages=1000), max_batch_size=8, num_draft_tokens=N,
                          max_prefill_tokens=12)
    first, long = request(0, 4), request(1, 40)
    scheduler.add(first)
    scheduler.add(long)
    scheduler.admit()
    long.prefilled = 8
    assert scheduler.preempt() is long and long.prefilled == 0
    assert scheduler.running == [first] and list(scheduler.waiting) == [long] and scheduler.prefilling is None
    assert [(c.start, c.end) for c in scheduler.admit()] == [(0, 12)]


def test_requeue_keeps_the_chunks_already_prefilled():
    scheduler = Scheduler(PagedKVCache(1, 1, 8, num_pages=1000), max_batch_size=8, num_draft_tokens=N,
                          max_prefill_tokens=12)
    long, short = request(0, 20), request(1, 3)
    scheduler.add(long)
    scheduler.admit()
    long.prefilled = 12
    scheduler.add(short)
    chunks = scheduler.admit()                   # long's last 8 and short, whole
    assert scheduler.running == [long, short]
    scheduler.requeue(chunks)                    # their forward found no pages
    assert scheduler.prefilling is long and long.prefilled == 12 and scheduler.running == []
    assert list(scheduler.waiting) == [short]
    assert [(c.req, c.start, c.end) for c in scheduler.admit()] == [(long, 12, 20), (short, 0, 3)]


def test_a_lone_request_needs_its_sequence_and_one_token_not_a_tree():
    """With nothing running, a step without room for a tree verifies the root alone: a request
    is admitted when the pool holds its sequence plus one token, even with no room for a tree."""
    for pages, admitted in ((10, False), (11, True)):
        scheduler = Scheduler(PagedKVCache(1, 1, 8, num_pages=pages), max_batch_size=4, num_draft_tokens=N)
        lone = request(0, 10)
        scheduler.add(lone)
        assert admitted_requests(scheduler) == ([lone] if admitted else []), pages


def test_requeued_requests_go_back_to_the_front_of_the_queue_in_their_order():
    """An admission undone (its prefill found no pages) puts the requests it admitted back at the
    head of the queue in FIFO order, ahead of the ones that never left it."""
    scheduler = Scheduler(PagedKVCache(1, 1, 8, num_pages=1000), max_batch_size=2, num_draft_tokens=N)
    first, second, third = request(0, 4), request(1, 5), request(2, 6)
    for r in (first, second, third):
        scheduler.add(r)
    chunks = scheduler.admit()
    assert [c.req for c in chunks] == [first, second]
    scheduler.requeue(chunks)
    assert list(scheduler.waiting) == [first, second, third] and scheduler.running == []
    assert [c.req for c in scheduler.admit()] == [first, second]


def test_a_request_waits_for_a_prompt_prefilled_alongside_only_past_shared_prefix_wait():
    """A waiting request that shares a prompt prefilled in the same step waits a step only when
    more than SHARED_PREFIX_WAIT of its tokens would then be read from that prompt's pages; it can
    read full pages of all of its prompt but the last token (whose logits sample the first)."""
    page = 16
    assert SHARED_PREFIX_WAIT == 2 * page
    prompt = list(range(1, 3 * page + 1))                  # 48 tokens: 47 readable, 2 full pages = 32
    for other, waits in ((prompt, False), (prompt + [7], True)):  # 48 readable: 3 full pages = 48
        cache = PagedKVCache(1, 1, 8, num_pages=1000, page_size=page, prefix_caching=True)
        scheduler = Scheduler(cache, max_batch_size=4, num_draft_tokens=N)
        first = Request(0, prompt, SamplingParams(), eos_token_ids=[0])
        second = Request(1, other, SamplingParams(), eos_token_ids=[0])
        scheduler.add(first)
        scheduler.add(second)
        admitted = [c.req for c in scheduler.admit()]
        assert admitted == ([first] if waits else [first, second]), len(other)


def test_a_newcomer_leaves_the_request_prefilled_in_chunks_its_whole_sequence_and_tree():
    """The request prefilled in chunks holds pages for its chunks so far only; a newcomer admitted
    beside its last chunk must leave it the rest of its sequence and its first tree."""
    for pages, admitted in ((12 + 20 + N - 12 + 3 + N - 1, False), (12 + 20 + N - 12 + 3 + N, True)):
        scheduler = Scheduler(PagedKVCache(1, 1, 8, num_pages=pages), max_batch_size=4, num_draft_tokens=N,
                              max_prefill_tokens=12)
        long = request(0, 20)
        scheduler.add(long)
        assert [(c.start, c.end) for c in scheduler.admit()] == [(0, 12)]
        scheduler.cache.reserve([0], [12])                # its first chunk's K/V
        long.prefilled = 12
        newcomer = request(1, 3)
        scheduler.add(newcomer)
        chunks = [(c.req, c.start, c.end) for c in scheduler.admit()]
        assert chunks == [(long, 12, 20)] + ([(newcomer, 0, 3)] if admitted else []), pages
