"""Prefix caching through the engine: requests that share a prefix prefill only what is new,
and every output, logprob and draft (hence accept length) is that of an engine without it."""

import pytest

from specflow.engine import SpecEngine
from specflow.request import Status
from specflow.sampling import SamplingParams
from tests.test_chunked_prefill import DRAFTERS, engine, prefill_sizes

SYSTEM = "import os\nimport sys\n" * 6                      # 36 tokens shared by every prompt
PROMPTS = [SYSTEM + "def main(", SYSTEM + "class Tree:\n", SYSTEM + "for i in range(10):\n", SYSTEM + "def main("]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def one_at_a_time(eng: SpecEngine, prompts, params=GREEDY):
    return [eng.generate([p], params)[0] for p in prompts]


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_shared_prefixes_are_prefilled_once_with_the_same_outputs_and_drafts(drafter):
    engines, fed = [engine(drafter), engine(drafter, prefix_caching=True)], [[], []]
    for eng, counts in zip(engines, fed):  # tokens fed to a drafter's own model (a draft model, an EAGLE head)
        if hasattr(eng.drafter, "runner"):
            extend = eng.drafter.runner.runner.extend
            eng.drafter.runner.runner.extend = lambda ids, tokens, extend=extend, counts=counts, **kw: \
                counts.append(sum(map(len, tokens))) or extend(ids, tokens, **kw)
    cold = one_at_a_time(engines[0], PROMPTS)
    sizes = prefill_sizes(engines[1])
    outs = one_at_a_time(engines[1], PROMPTS)
    assert [o.token_ids for o in outs] == [o.token_ids for o in cold]
    assert [o.accept_lengths for o in outs] == [o.accept_lengths for o in cold]  # the drafts too
    lens, shared = [len(o.prompt_token_ids) for o in outs], len(engines[1].encode(SYSTEM))
    # the first prompt whole; then all but the shared system prompt (the repeat: its last token)
    assert [s for (s,) in sizes] == [lens[0]] + [n - shared for n in lens[1:3]] + [1]
    # the drafter's own model reuses its cached pages of the prefix too
    assert not fed[0] or sum(fed[1]) <= sum(fed[0]) - 2 * shared


@pytest.mark.parametrize("drafter", ["eagle", "eagle3"])
def test_an_eagle_head_shares_no_pages_between_prompts_that_differ_in_their_first_token(drafter):
    """An EAGLE head's first entry reads the target feature of the sequence's first token, so its
    cached pages are keyed after that token: two prompts equal but for their first token share
    none of the head's pages, and draft as an engine without prefix caching does."""
    engines, fed = [engine(drafter), engine(drafter, prefix_caching=True)], [[], []]
    for eng, counts in zip(engines, fed):
        extend = eng.drafter.runner.runner.extend
        eng.drafter.runner.runner.extend = lambda ids, tokens, extend=extend, counts=counts, **kw: \
            counts.append(sum(map(len, tokens))) or extend(ids, tokens, **kw)
    rest = engines[0].encode(SYSTEM + "def main(")
    prompts = [[5] + rest, [9] + rest]
    cold = one_at_a_time(engines[0], prompts)
    outs = one_at_a_time(engines[1], prompts)
    assert [o.token_ids for o in outs] == [o.token_ids for o in cold]
    assert [o.accept_lengths for o in outs] == [o.accept_lengths for o in cold]
    assert sum(fed[1]) == sum(fed[0])  # the head computed both prompts whole


def test_sampled_outputs_and_logprobs_are_those_without_it():
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=3, logprobs=2)
    cold = one_at_a_time(engine("eagle"), PROMPTS, params)
    outs = one_at_a_time(engine("eagle", prefix_caching=True), PROMPTS, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in cold]
    assert [[round(x.logprob, 3) for x in o.logprobs] for o in outs] == \
           [[round(x.logprob, 3) for x in o.logprobs] for o in cold]


def test_prompt_logprobs_requests_compute_their_whole_prompt():
    eng = engine(prefix_caching=True)
    sizes = prefill_sizes(eng)
    eng.generate([PROMPTS[0]], GREEDY)
    out = eng.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1))[0]
    assert sizes[1] == [len(out.prompt_token_ids)] and len(out.prompt_logprobs) == len(out.prompt_token_ids)


def test_a_full_pool_evicts_cached_pages_least_recently_used_first():
    prompts = [f"def f{i}(x):\n    return x * {i}\n" * 3 for i in range(8)]
    cold = engine("eagle").generate(prompts, GREEDY)
    small = engine("eagle", prefix_caching=True, kv_cache_tokens=160, max_batch_size=2)
    outs = small.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in cold]
    assert small.runner.cache.prefix.num_cached <= 160
    assert small.runner.cache.prefix.num_evictable == small.runner.cache.num_pages_used  # none held


@pytest.mark.parametrize("page_size", [1, 4])
def test_with_chunked_prefill_and_a_concurrent_batch(page_size):
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (20, 8, 30, 12)]
    cold = engine("eagle3").generate(PROMPTS * 2, params * 2)
    cached = engine("eagle3", prefix_caching=True, max_prefill_tokens=20, page_size=page_size)
    outs = cached.generate(PROMPTS * 2, params * 2) + [cached.generate([p], q)[0] for p, q in zip(PROMPTS, params)]
    assert [o.token_ids for o in outs] == [o.token_ids for o in cold + cold[:4]]
    assert [o.accept_lengths for o in outs] == [o.accept_lengths for o in cold + cold[:4]]
    # full pages of the shared system prompt, in a later batch
    shared = len(cached.encode(SYSTEM))
    assert all(o.num_cached_tokens >= shared // page_size * page_size for o in outs[8:])


def test_preempted_requests_give_the_same_outputs():
    """A preempted request's pages are cached as it leaves (the pool soon evicts them, as it
    needs the room); it resumes from what is still cached."""
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    cold = engine("eagle", kv_cache_tokens=4096).generate(PROMPTS[:3], params)
    tight = engine("eagle", prefix_caching=True, kv_cache_tokens=200)
    sizes = prefill_sizes(tight)
    outs = tight.generate(PROMPTS[:3], params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in cold]
    assert len([s for step in sizes for s in step]) > 3  # someone was preempted and prefilled again


@pytest.mark.parametrize("drafter", ["eagle", "eagle3", "plain"])
def test_a_conversation_reuses_the_last_turn_with_its_answer(drafter):
    """The next turn's prompt holds the last answer: its K/V (and the target features the drafter
    reads), computed while it was generated, are reused."""
    turns = []
    for eng in (engine(drafter), engine(drafter, prefix_caching=True)):
        sizes = prefill_sizes(eng)
        prompt = eng.encode(PROMPTS[0])
        first = eng.generate([prompt], GREEDY)[0]
        follow_up = eng.encode("\n\n# now the tests\n")
        second = eng.generate([prompt + first.token_ids + follow_up], GREEDY)[0]
        turns.append((first.token_ids, second.token_ids, first.accept_lengths, second.accept_lengths, sizes))
    (*cold, _), (*cached, sizes) = turns
    assert cached == cold
    # the follow-up, and the answer's last token where its K/V was not computed (the last step's
    # bonus token; a draft accepted past max_tokens has it)
    assert sizes[1][0] in (len(follow_up), 1 + len(follow_up))


def test_a_burst_sharing_a_system_prompt_computes_it_once():
    """Requests admitted together that share a long prefix: the first prefills it, the others wait
    one step and read its pages (SGLang's in-batch prefix caching); n choices of one prompt too."""
    prompts = [SYSTEM * 3 + q for q in ("def main(", "class Tree:\n", "for i in range(10):\n")] * 2
    cold = engine("eagle").generate(prompts, GREEDY)
    cached = engine("eagle", prefix_caching=True)
    sizes = prefill_sizes(cached)
    outs = cached.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in cold]
    assert [o.accept_lengths for o in outs] == [o.accept_lengths for o in cold]
    shared = len(cached.encode(SYSTEM * 3))
    assert sizes[0] == [len(outs[0].prompt_token_ids)]                     # the first one alone
    assert sum(map(sum, sizes)) < len(outs[0].prompt_token_ids) + 5 * (len(outs[0].prompt_token_ids) - shared + 2)
    assert all(o.num_cached_tokens >= shared - 1 for o in outs[1:])


def test_a_request_waits_for_a_prompt_prefilled_alongside_only_for_pages_it_can_read():
    """With pages larger than what two prompts share, no page of it can be cached: both are
    prefilled in the same step, rather than the second waiting a step to compute it all anyway."""
    shared = list(range(100, 145))                                    # 45 tokens, < one page of 64
    prompts = [shared + [5, 6, 7, 8, 9], shared + [9, 8, 7, 6, 5]]
    cold = engine("eagle", page_size=64).generate(prompts, GREEDY)
    cached = engine("eagle", prefix_caching=True, page_size=64)
    sizes = prefill_sizes(cached)
    outs = cached.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in cold]
    assert sizes[0] == [50, 50]


def test_a_prompt_preempted_mid_prefill_does_not_count_its_own_chunks_as_cached():
    """num_cached_tokens (usage.prompt_tokens_details.cached_tokens) is what the cache held when
    the prompt's prefill began (as vLLM counts it): a prompt nobody else sent, preempted while
    prefilled in chunks, finds its own chunks cached when it resumes; they were not reused."""
    import random

    rng = random.Random(1)
    unique = [rng.randrange(3, 700) for _ in range(60)]
    short = [[rng.randrange(3, 700) for _ in range(10)] for _ in range(2)]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    eng = engine(prefix_caching=True, page_size=4, max_prefill_tokens=8, kv_cache_tokens=96, max_batch_size=4)
    sizes = prefill_sizes(eng)
    outs = eng.generate(short + [unique], params)
    assert sum(map(sum, sizes)) > sum(len(o.prompt_token_ids) for o in outs)  # someone was preempted mid-prefill
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0]
    assert [o.token_ids for o in outs] == [o.token_ids for o in engine().generate(short + [unique], params)]


def test_an_eagle_request_whose_first_build_was_given_up_then_out_of_pages_commits():
    """A one-token prompt has no EAGLE entry before its first root; a build given up, truncated
    in a plan that then runs out of drafter pages, leaves it an empty block table: the root-only
    step's commit must not try to match the cache again."""
    import torch

    from specflow.runtime.kv_cache import OutOfPages
    from specflow.tree import DraftTree, Frontier, Roots

    eng = SpecEngine("zoo/tiny-code/target", {"type": "eagle", "path": "zoo/tiny-code/eagle", "kv_cache_tokens": 64},
                     {"type": "eagle2", "topk": 4, "depth": 3, "num_draft_tokens": 8}, {"type": "greedy"},
                     device="cpu", dtype="float32", prefix_caching=True)
    d = eng.drafter
    runner, cache, f = d.runner, d.runner.runner.cache, d.runner.runner.model.config.hidden_size

    def expand(roots):
        frontier = Frontier(roots, DraftTree.root_only(roots), torch.zeros(roots.batch_size, 1, dtype=torch.long), 4,
                            False)
        runner.expand(frontier, d.head.compute_logits, d.vocab_size, d.head.draft_to_target)

    with torch.inference_mode():
        runner.add_pending(1, [5], torch.randn(1, f))
        expand(Roots([1], torch.tensor([7]), torch.tensor([1]), [[5, 7]]))  # its build, then given up
        runner.add_pending(2, [5, 6, 7, 8, 9], torch.randn(5, f))
        cache.reserve([99], [cache.allocator.num_free * cache.page_size])   # the pool is full
        with pytest.raises(OutOfPages):
            expand(Roots([1, 2], torch.tensor([7, 3]), torch.tensor([1, 5]), [[5, 7], [5, 6, 7, 8, 9, 3]]))
        runner.commit([1, 2], [[7], [3]], [torch.randn(1, f), torch.randn(1, f)])  # roots only
    assert runner.states[1].committed + len(runner.states[1].pending) == 1
    runner.release([1, 2])
    cache.release(99)
    assert cache.num_pages_used == cache.prefix.num_evictable


def test_a_waiting_head_is_matched_again_only_when_it_could_fit():
    """A queue head the pool cannot hold is matched once, and not again every step while it
    waits (milliseconds for a long prefix): not until the pool could hold it were its match
    longer by every page cached since. Once the running request ends, it runs with its cached
    prefix, as alone."""
    eng = engine(prefix_caching=True, kv_cache_tokens=160, max_batch_size=4)
    long = SYSTEM + "".join(f"x{i} = {i}\n" for i in range(12))
    alone = one_at_a_time(engine(), [long])[0]
    eng.generate([SYSTEM], GREEDY)  # the system prompt's pages cached
    eng.add_request(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=110, ignore_eos=True))  # running
    for _ in range(70):  # (the pool then has fewer free pages than the head's tokens past the system prompt)
        eng.step()
    head = eng.add_request(long, GREEDY)
    prefix = eng.runner.cache.prefix
    matched, match = [], prefix.match
    prefix.match = lambda *a, **kw: matched.append(len(eng.scheduler.running)) or match(*a, **kw)
    outputs, waited = {}, 0
    while eng.has_unfinished():
        outputs.update({o.request_id: o for o in eng.step()})
        waited += head in eng._requests and eng._requests[head].status is Status.WAITING
    assert waited > 20 and matched == [1, 0]  # matched when it came, then once the running request had ended
    assert outputs[head].token_ids == alone.token_ids and outputs[head].num_cached_tokens > 0


def test_a_waiting_head_is_matched_again_once_pages_it_can_share_are_cached():
    """A head that did not fit is looked up again as soon as the pages cached since could make
    it fit (PrefixCache.num_inserted), also while the request that cached them holds them: here
    the prompt prefilled in chunks ahead of it, whose first 32 tokens it shares (not enough to
    wait for them, SHARED_PREFIX_WAIT), cached once its last chunk is in. The head then runs
    beside it, reading those pages, rather than waiting for it to end."""
    eng = engine(kv_cache_tokens=90, max_prefill_tokens=8, prefix_caching=True, max_batch_size=4)
    shared = list(range(3, 35))                                                        # 32 tokens
    first = eng.add_request(shared + [100, 101, 102, 103],                             # chunks 8, 8, 8, 8, 4
                            SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    head = eng.add_request(shared + list(range(200, 240)), SamplingParams(temperature=0.0, max_tokens=4,
                                                                          ignore_eos=True))
    outputs = []
    while eng.has_unfinished():
        outputs += eng.step()
    assert [o.request_id for o in outputs] == [head, first] and outputs[0].num_cached_tokens == len(shared)
