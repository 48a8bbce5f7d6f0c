"""Chunked prefill: a prompt longer than what is left of ``max_prefill_tokens`` is prefilled over
several steps; outputs, prompt logprobs and the drafters' target features (hence their drafts
and accept lengths) are those of a prefill in one piece."""

import pytest
import torch

from specflow.engine import SpecEngine
from specflow.sampling import SamplingParams
from tests.runtime import graph_emulator

ZOO = "zoo/tiny-code"
PROMPTS = ["def main(", "import os\nimport sys\n" * 3, "class Tree:\n    def __init__(self, left, right):\n" * 2,
           "for i in range(10):\n    print(i)\n" * 4]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
DRAFTERS = {"eagle": {"type": "eagle", "path": f"{ZOO}/eagle"}, "eagle3": {"type": "eagle3", "path": f"{ZOO}/eagle3"},
            "medusa": {"type": "medusa", "path": f"{ZOO}/medusa"}, "draft": {"type": "draft_model", "path": f"{ZOO}/draft"},
            "ngram": {"type": "ngram"}, "plain": None}
TREE = {"type": "eagle2", "topk": 4, "depth": 3, "num_draft_tokens": 8}


def engine(drafter=None, **kwargs) -> SpecEngine:
    return SpecEngine(f"{ZOO}/target", drafter and DRAFTERS[drafter], TREE if drafter else None, {"type": "greedy"},
                      device="cpu", dtype="float32", **kwargs)


def prefill_sizes(eng: SpecEngine) -> list[list[int]]:
    """Records each prefill forward's token counts per request."""
    sizes, extend = [], eng.runner.extend
    eng.runner.extend = lambda ids, tokens, **kw: (kw.get("logits") == "last" and sizes.append(
        [len(t) for t in tokens])) or extend(ids, tokens, **kw)
    return sizes


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_drafts_and_outputs_are_those_of_a_whole_prefill(drafter):
    whole = engine(drafter).generate(PROMPTS, GREEDY)
    chunked = engine(drafter, max_prefill_tokens=7)
    sizes, fed = prefill_sizes(chunked), []
    if hasattr(chunked.drafter, "runner"):  # a model of its own: the prompt reaches it in chunks too
        extend = chunked.drafter.runner.runner.extend
        chunked.drafter.runner.runner.extend = lambda ids, tokens, **kw: fed.extend(map(len, tokens)) or \
            extend(ids, tokens, **kw)
    outs = chunked.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in whole]
    # the drafter saw the same target features: it drafted the same trees
    assert [o.accept_lengths for o in outs] == [o.accept_lengths for o in whole]
    assert all(sum(step) <= 7 for step in sizes) and max(map(len, sizes)) > 1
    assert sum(map(sum, sizes)) == sum(len(o.prompt_token_ids) for o in outs)
    assert max(fed, default=0) <= 7 + 1  # pending tokens and the root (tree levels feed fewer here)


def test_chunks_replayed_from_graphs_give_the_same_drafts(monkeypatch):
    """Chunks short enough for a verification graph replay it (CUDA-graph capture emulated on the
    CPU): the features held from them are the eager forward's."""
    graph_emulator.install(monkeypatch)
    whole = engine("eagle", cuda_graphs=True).generate(PROMPTS, GREEDY)
    outs = engine("eagle", cuda_graphs=True, max_prefill_tokens=5).generate(PROMPTS, GREEDY)
    assert [o.accept_lengths for o in outs] == [o.accept_lengths for o in whole]


def test_prompt_logprobs_are_those_of_a_whole_prefill():
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    whole = engine().generate(PROMPTS, params)
    outs = engine(max_prefill_tokens=6).generate(PROMPTS, params)
    for a, b in zip(outs, whole):
        assert len(a.prompt_logprobs) == len(a.prompt_token_ids) and a.prompt_logprobs[0] is None
        assert [(x.token_id, [t for t, _ in x.top]) for x in a.prompt_logprobs[1:]] == \
               [(x.token_id, [t for t, _ in x.top]) for x in b.prompt_logprobs[1:]]
        torch.testing.assert_close(torch.tensor([[x.logprob] + [v for _, v in x.top] for x in a.prompt_logprobs[1:]]),
                                   torch.tensor([[x.logprob] + [v for _, v in x.top] for x in b.prompt_logprobs[1:]]))


def test_prompts_are_prefilled_in_fifo_order_up_to_the_bound():
    eng = engine(max_prefill_tokens=10)
    sizes = prefill_sizes(eng)
    prompts = [list(range(3, 3 + n)) for n in (4, 25, 12)]
    eng.generate(prompts, GREEDY)
    # 4 + the 25-token prompt's first 6; its next 10; its last 9 + 1 of the 12 (now chunked)
    assert sizes == [[4, 6], [10], [9, 1], [10], [1]]


def test_abort_while_prefilling_in_chunks_frees_its_pages():
    eng = engine("eagle", max_prefill_tokens=8)
    rid = eng.add_request(PROMPTS[3], GREEDY)
    eng.step()
    assert eng.scheduler.prefilling is not None and eng.runner.cache.num_pages_used > 0 and eng._feed.held
    eng.abort(rid)
    assert eng.runner.cache.num_pages_used == 0 and not eng._feed.held and not eng.has_unfinished()


def test_preempted_while_prefilling_it_starts_over_with_the_same_result():
    """Out of pages, the request being prefilled in chunks is preempted first, its chunks and
    prompt logprobs dropped, and later prefilled again from its first token."""
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, prompt_logprobs=1) for n in (60, 24)]
    prompts = [PROMPTS[0], PROMPTS[3]]  # 4 and 56 tokens
    whole = engine("eagle", kv_cache_tokens=4096).generate(prompts, params)
    # the first request grows 2-3 tokens a step while the second is prefilled 2 a step
    tight = engine("eagle", kv_cache_tokens=100, max_prefill_tokens=2)
    preempted, preempt = [], tight.scheduler.preempt
    tight.scheduler.preempt = lambda: preempted.append(tight.scheduler.prefilling is not None) or preempt()
    outs = tight.generate(prompts, params)
    assert True in preempted
    assert [o.token_ids for o in outs] == [o.token_ids for o in whole]
    assert [[x and x.token_id for x in o.prompt_logprobs] for o in outs] == \
           [[x and x.token_id for x in o.prompt_logprobs] for o in whole]
