"""SpecEngine additions for serving: logprobs of committed tokens (from the target at the node
that committed each one, so speculation does not change them) and ``snapshot`` of running
requests between steps."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from specflow import SamplingParams, SpecEngine

PROMPTS = [[5, 17, 99, 3, 42, 8, 1, 77, 23], [9, 31, 7, 120, 56], [200, 4, 4, 4, 13, 250, 11, 2, 90]]


@pytest.fixture(scope="module")
def plain(tiny_target):
    return SpecEngine(tiny_target, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def speculative(tiny_target, plain):
    """The target drafts for itself, so most drafts are accepted and each step commits several
    tokens: accepted drafts and the bonus both need their logprobs."""
    return SpecEngine(plain.model, {"type": "draft_model", "path": str(tiny_target)},
                      {"type": "eagle2", "topk": 2, "depth": 3, "num_draft_tokens": 6}, {"type": "rejection"},
                      tokenizer=plain.tokenizer)


def test_logprobs_under_speculation_equal_plain_decoding(plain, speculative):
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=4)
    a, b = plain.generate(PROMPTS, params), speculative.generate(PROMPTS, params)
    assert max(max(o.accept_lengths) for o in b) > 1
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert [lp.token_id for lp in y.logprobs] == y.token_ids
        torch.testing.assert_close(torch.tensor([[lp.logprob] + [v for _, v in lp.top] for lp in y.logprobs]),
                                   torch.tensor([[lp.logprob] + [v for _, v in lp.top] for lp in x.logprobs]))
        assert [[t for t, _ in lp.top] for lp in y.logprobs] == [[t for t, _ in lp.top] for lp in x.logprobs]
        assert all(lp.top[0] == (lp.token_id, lp.logprob) for lp in y.logprobs)   # greedy took the argmax


def test_logprobs_are_the_targets_log_softmax(plain, tiny_target):
    """Raw model log-probabilities (before temperature and filters), checked against transformers."""
    out = plain.generate(PROMPTS[:1], SamplingParams(temperature=0.7, top_k=5, seed=0, max_tokens=5,
                                                     ignore_eos=True, logprobs=0))[0]
    hf = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    ids = torch.tensor(PROMPTS[0] + out.token_ids)
    with torch.no_grad():
        logits = hf(ids[None]).logits[0]                                             # [T, V]
    expected = torch.log_softmax(logits[len(PROMPTS[0]) - 1:-1].float(), -1).gather(-1, ids[len(PROMPTS[0]):, None])
    torch.testing.assert_close(torch.tensor([lp.logprob for lp in out.logprobs]), expected[:, 0])
    assert all(lp.top == [] for lp in out.logprobs)


def test_prompt_logprobs_are_the_targets_log_softmax_over_the_prompt(plain, speculative, tiny_target):
    """Each prompt token given the ones before it (transformers over the prompt), the first None;
    the same with a drafter, beside requests that ask for none, and for a one-token prompt."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    asked = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=3)
    mixed = [asked, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), asked]
    alone = plain.generate(PROMPTS[1:2], mixed[1])[0]
    for engine in (plain, speculative):
        outs = engine.generate(PROMPTS, mixed)
        assert outs[1].prompt_logprobs is None and outs[1].token_ids == alone.token_ids
        for prompt, out in zip(PROMPTS[::2], outs[::2]):
            ids = torch.tensor(prompt)
            with torch.no_grad():
                logp = torch.log_softmax(hf(ids[None]).logits[0, :-1].float(), -1)             # [P - 1, V]
            assert out.prompt_logprobs[0] is None and [lp.token_id for lp in out.prompt_logprobs[1:]] == prompt[1:]
            torch.testing.assert_close(torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]]),
                                       logp.gather(-1, ids[1:, None])[:, 0])
            top = logp.topk(3)
            assert [[t for t, _ in lp.top] for lp in out.prompt_logprobs[1:]] == top.indices.tolist()
    assert engine.generate([[7]], asked)[0].prompt_logprobs == [None]


def test_logprobs_follow_stop_truncation_and_are_off_by_default(speculative):
    free = speculative.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))[0]
    assert free.logprobs is None
    stop_at = free.token_ids[7]
    out = speculative.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=20, logprobs=1,
                                                           stop_token_ids=[stop_at]))[0]
    assert out.finish_reason == "stop" and len(out.logprobs) == len(out.token_ids) == out.token_ids.index(stop_at) + 1


def test_snapshot_shows_progress_between_steps(speculative):
    rid = speculative.add_request(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    seen = []
    while speculative.has_unfinished():
        finished = speculative.step()
        seen.append([o.token_ids for o in speculative.snapshot([rid])])
    assert seen[-1] == [] and finished[0].request_id == rid   # finished requests leave the snapshot
    lengths = [len(s[0]) for s in seen[:-1]]
    assert lengths == sorted(lengths) and lengths[0] >= 1
    assert all(finished[0].token_ids[:len(s[0])] == s[0] for s in seen[:-1])


def test_a_snapshot_since_what_was_seen_lists_only_what_came_after(speculative):
    """A stream's update (the server's, each step): the lists past the tokens and steps already
    seen, prompt logprobs only while no token was; the text whole."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    rid = speculative.add_request(PROMPTS[0], params)
    while speculative.has_unfinished():
        speculative.step()
        (full,) = speculative.snapshot([rid]) or [None]
        if full is None:
            break
        for tokens, steps in ((0, 0), (1, 1), (len(full.token_ids), len(full.accept_lengths))):
            (part,) = speculative.snapshot([rid], since={rid: (tokens, steps)})
            assert part.token_ids == full.token_ids[tokens:] and part.logprobs == full.logprobs[tokens:]
            assert (part.accept_lengths, part.tried_depths, part.steps) == (
                full.accept_lengths[steps:], full.tried_depths[steps:], full.steps[steps:])
            assert part.prompt_logprobs == (full.prompt_logprobs if tokens == 0 else None)
            assert part.text == full.text


@pytest.mark.parametrize("name", ["plain", "speculative"])
def test_a_batch_with_different_logprob_counts(name, request):
    """Logprobs are computed on the device for the batch's largest count, with one copy back
    a step: each request keeps its own number of alternatives, equal to its run alone, and
    requests without logprobs get none."""
    engine = request.getfixturevalue(name)
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=n) for n in (None, 0, 3)]
    together = engine.generate(PROMPTS, params)
    alone = [engine.generate([p], sp)[0] for p, sp in zip(PROMPTS, params)]
    assert together[0].logprobs is None and [len(lp.top) for lp in together[2].logprobs] == [3] * 12
    for x, y in zip(together[1:], alone[1:]):
        assert x.token_ids == y.token_ids and [lp.token_id for lp in x.logprobs] == x.token_ids
        assert [[t for t, _ in lp.top] for lp in x.logprobs] == [[t for t, _ in lp.top] for lp in y.logprobs]
        torch.testing.assert_close(torch.tensor([[lp.logprob] + [v for _, v in lp.top] for lp in x.logprobs]),
                                   torch.tensor([[lp.logprob] + [v for _, v in lp.top] for lp in y.logprobs]))


def test_prompt_logprobs_take_the_prompt_logits_a_slice_at_a_time(plain, monkeypatch):
    """A long prompt's (or a long prefill's) [P, V] logits are never all live at once: the
    logits of a 16k-token prefill with a 128k vocabulary would take ~25 GiB."""
    import specflow.logprobs

    asked = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=2)
    prompts = [PROMPTS[0] * 3, [7], PROMPTS[1] * 2]                                 # 27, 1 and 10 tokens
    whole = plain.generate(prompts, asked)
    monkeypatch.setattr(specflow.logprobs, "PROMPT_LOGITS_ROWS", 8)
    rows, compute = [], plain.model.compute_logits
    monkeypatch.setattr(plain.model, "compute_logits", lambda hidden: rows.append(len(hidden)) or compute(hidden))
    sliced = plain.generate(prompts, asked)
    assert max(rows) <= 8
    for a, b in zip(whole, sliced):
        assert len(b.prompt_logprobs) == len(b.prompt_token_ids) and b.prompt_logprobs[0] is None
        assert [lp.token_id for lp in b.prompt_logprobs[1:]] == b.prompt_token_ids[1:]
        values = [[(lp.logprob, *(v for _, v in lp.top)) for lp in o.prompt_logprobs[1:]] for o in (a, b)]
        torch.testing.assert_close(torch.tensor(values[1]), torch.tensor(values[0]))   # (matmuls of other sizes)
        assert [[t for t, _ in lp.top] for lp in b.prompt_logprobs[1:]] == \
            [[t for t, _ in lp.top] for lp in a.prompt_logprobs[1:]]


def test_a_request_preempted_after_its_first_tokens_keeps_one_prompt_logprob_per_prompt_token(plain, tiny_target):
    """A preempted request that already generated resumes by prefilling its sequence again; its
    prompt logprobs were taken at its first prefill and are not taken again (nor extended by the
    generated tokens recomputed): they equal those of an engine without KV pressure."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    expected = plain.generate(PROMPTS * 2, params)
    small = SpecEngine(plain.model, tokenizer=plain.tokenizer, kv_cache_tokens=80, page_size=4)
    prefills = []
    extend = small.runner.extend
    small.runner.extend = lambda ids, tokens, **kw: (kw.get("logits") == "last" and prefills.append(
        sum(map(len, tokens)))) or extend(ids, tokens, **kw)
    outs = small.generate(PROMPTS * 2, params)
    assert sum(prefills) > sum(map(len, PROMPTS * 2))  # someone was preempted and prefilled again
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    for out, ref in zip(outs, expected):
        assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
        assert [lp and (lp.token_id, round(lp.logprob, 4)) for lp in out.prompt_logprobs] == \
               [lp and (lp.token_id, round(lp.logprob, 4)) for lp in ref.prompt_logprobs]
