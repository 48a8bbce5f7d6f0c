"""History-dependent logit adjustments (specflow.penalties): every tree node is adjusted by its
own path as a reference written token by token adjusts it, and speculative decoding with them
gives plain decoding's output with them (greedy: token for token; seeded exact match too)."""

import collections
import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specflow import SamplingParams, SpecEngine
from specflow.models import load_model, load_tokenizer
from specflow.penalties import History, Penalties, PenaltyState
from specflow.runtime.model_runner import ModelRunner
from tests.test_lossless import PROMPTS, TREES, drafters
from tests.verifiers.test_greedy import VOCAB, random_trees


def reference_logits(raw: list[float], prompt: list[int], output: list[int], params: SamplingParams,
                     stop_ids: set[int]) -> list[float]:
    """The adjusted logits of the token after ``prompt + output``, one token at a time (vLLM's order)."""
    logits = [x + (params.logit_bias or {}).get(t, 0.0) for t, x in enumerate(raw)]
    if len(output) < params.min_tokens:
        for t in stop_ids:
            logits[t] = -math.inf
    r = params.repetition_penalty
    for t in set(prompt) | set(output):
        logits[t] = logits[t] / r if logits[t] > 0 else logits[t] * r
    for t, count in collections.Counter(output).items():
        logits[t] -= params.frequency_penalty * count + params.presence_penalty
    return logits


@st.composite
def histories(draw, vocab: int) -> History:
    token = st.integers(0, vocab - 1)
    params = SamplingParams(
        max_tokens=64, min_tokens=draw(st.integers(0, 6)),
        repetition_penalty=draw(st.sampled_from([1.0, 0.7, 1.5])),
        frequency_penalty=draw(st.sampled_from([0.0, 0.5, -0.4])),
        presence_penalty=draw(st.sampled_from([0.0, 0.3, -1.0])),
        logit_bias=draw(st.dictionaries(token, st.sampled_from([-100.0, -2.5, 3.0]), max_size=2)))
    return History(params, draw(st.lists(token, min_size=1, max_size=5)), draw(st.lists(token, max_size=5)),
                   set(draw(st.lists(token, max_size=2))))


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_every_node_is_adjusted_by_its_own_path(data):
    tree = data.draw(random_trees())
    b, n = tree.tokens.shape
    rows = [data.draw(histories(VOCAB)) for _ in range(b)]
    logits = torch.randn(b, n, VOCAB, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 99)))) * 3
    adjusted = Penalties.build(rows, VOCAB, torch.device("cpu")).apply(logits, tree)
    for r, h in enumerate(rows):
        for node in range(n):
            if tree.valid[r, node]:
                path = [int(tree.tokens[r, i]) for i in tree.path_to(r, node)[1:]]  # (the root is the sequence's)
                want = reference_logits(logits[r, node].tolist(), h.prompt_ids, h.output_ids + path, h.params,
                                        h.stop_ids)
                torch.testing.assert_close(adjusted[r, node], torch.tensor(want), rtol=1e-6, atol=1e-5)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_tokens_in_flight_count_as_generated(data):
    rows = [data.draw(histories(VOCAB)) for _ in range(data.draw(st.integers(1, 4)))]
    flight = [data.draw(st.integers(0, VOCAB - 1)) for _ in rows]
    ahead = [data.draw(st.booleans()) for _ in rows]
    logits = torch.randn(len(rows), 1, VOCAB)
    got = Penalties.build(rows, VOCAB, torch.device("cpu")).after(torch.tensor(flight), torch.tensor(ahead))
    landed = [History(h.params, h.prompt_ids, h.output_ids + [t] * a, h.stop_ids) for h, t, a in zip(rows, flight, ahead)]
    want = Penalties.build(landed, VOCAB, torch.device("cpu"))
    torch.testing.assert_close(got.apply(logits), want.apply(logits))


FIELDS = ("counts", "seen", "bias", "held", "to_min", "repetition", "frequency", "presence")


def counted(method, calls: collections.Counter, key: str):
    """``method``, counting its calls in ``calls[key]``."""
    def counting(*args, **kwargs):
        calls[key] += 1
        return method(*args, **kwargs)
    return counting


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_the_state_follows_commits_and_releases_as_a_build_from_scratch(data):
    """PenaltyState, its requests committing tokens, gathered in any subsets, let go of (finished,
    preempted) and coming back, equals Penalties.build of their histories at every gather; a
    request's rows are made once from its history until they are let go of."""
    state, calls = PenaltyState(VOCAB, torch.device("cpu")), collections.Counter()
    state._take = counted(state._take, calls, "made")
    rows = [data.draw(histories(VOCAB)) for _ in range(data.draw(st.integers(1, 5)))]
    holding, made = set(), 0  # requests with rows, and how many times rows were made, by this test's count
    for _ in range(data.draw(st.integers(1, 12))):
        i = data.draw(st.integers(0, len(rows) - 1))
        op = data.draw(st.sampled_from(["commit", "gather", "release"]))
        if op == "commit":
            rows[i].output_ids.extend(data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=4)))
        elif op == "release":
            state.release(i)
            holding.discard(i)
        else:
            ids = sorted(data.draw(st.sets(st.integers(0, len(rows) - 1), min_size=1)))
            if not any(rows[j].params.adjusts_logits for j in ids):  # (the engine gathers no such batch)
                continue
            got = state.gather(ids, [rows[j] for j in ids])
            want = Penalties.build([rows[j] for j in ids], VOCAB, torch.device("cpu"))
            for name in FIELDS:
                torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=0, atol=0, msg=name)
            fresh = {j for j in ids if rows[j].params.adjusts_logits} - holding
            made, holding = made + len(fresh), holding | fresh
    assert calls["made"] == made and set(state.slots) == holding


def test_rows_without_adjustments_keep_their_bits():
    plain, biased = SamplingParams(), SamplingParams(repetition_penalty=1.2, logit_bias={1: 2.0}, min_tokens=3)
    rows = [History(plain, [1, 2], [2, 2], {0}), History(biased, [1, 2], [2, 2], {0})]
    logits = torch.randn(2, 4, VOCAB, dtype=torch.bfloat16)
    assert torch.equal(Penalties.build(rows[:1], VOCAB, torch.device("cpu")).apply(logits[:1]), logits[:1].float())
    adjusted = Penalties.build(rows, VOCAB, torch.device("cpu")).apply(logits)
    assert torch.equal(adjusted[0], logits[0].float()) and not torch.equal(adjusted[1], logits[1].float())


def test_bad_values_name_the_parameter(tiny_target):
    for bad, name in [(dict(repetition_penalty=0.0), "repetition_penalty"), (dict(min_tokens=9), "min_tokens"),
                      (dict(frequency_penalty=math.inf), "frequency_penalty"), (dict(logit_bias={"3": 1.0}), "logit_bias"),
                      (dict(logit_bias={3: math.nan}), "logit_bias"), (dict(presence_penalty="1"), "presence_penalty")]:
        with pytest.raises(ValueError, match=name):
            SamplingParams(max_tokens=8, **bad)
    engine = SpecEngine(tiny_target, kv_cache_tokens=256)
    with pytest.raises(ValueError, match="logit_bias token id 320 is not in"):
        engine.add_request([1, 2], SamplingParams(logit_bias={320: 1.0}))


PENALIZED = dict(max_tokens=20, ignore_eos=True, repetition_penalty=2.0, frequency_penalty=1.5, presence_penalty=1.0,
                 logit_bias={7: 4.0, 42: -100.0}, min_tokens=4, stop_token_ids=[5])


def reference_decode(model, prompt: list[int], params: SamplingParams) -> list[int]:
    """Greedy decoding written out: the whole sequence through the target at every token, the
    adjusted argmax, the stop token."""
    runner, out = ModelRunner(model, num_pages=1024), []
    while len(out) < params.max_tokens:
        raw = runner.extend([0], [prompt + out]).logits[-1].tolist()
        runner.release([0])
        logits = reference_logits(raw, prompt, out, params, set(params.stop_token_ids))
        out.append(max(range(len(logits)), key=logits.__getitem__))
        if out[-1] in params.stop_token_ids:
            break
    return out


@pytest.fixture(scope="module")
def model(tiny_target):
    return load_model(tiny_target)


@pytest.fixture(scope="module")
def greedy_reference(model):
    params = SamplingParams(temperature=0.0, **PENALIZED)
    plain = SpecEngine(model, kv_cache_tokens=2048).generate(PROMPTS, params)
    assert [o.token_ids for o in plain] == [reference_decode(model, p, params) for p in PROMPTS]
    unadjusted = SpecEngine(model, kv_cache_tokens=2048).generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=20))
    assert all(o.token_ids != u.token_ids for o, u in zip(plain, unadjusted))
    return [o.token_ids for o in plain]


@pytest.mark.parametrize("verifier", ["greedy", "rejection", "threshold", "typical"])
@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("drafter", ["ngram", "self_draft", "union"])
def test_greedy_with_penalties_equals_plain_decoding(model, tiny_target, tiny_draft, greedy_reference,
                                                     drafter, tree, verifier):
    engine = SpecEngine(model, drafters(tiny_target, tiny_draft)[drafter], TREES[tree], {"type": verifier},
                        kv_cache_tokens=2048)
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0.0, **PENALIZED))
    assert [o.token_ids for o in outs] == greedy_reference
    if drafter == "self_draft":  # (its drafts ignore the penalties, yet some are the adjusted argmax)
        assert max(a for o in outs for a in o.accept_lengths) > 1


@pytest.mark.parametrize("tree", ["chain", "eagle2"])
def test_seeded_sampling_with_penalties_equals_plain_decoding_with_exact_match(model, tiny_target, tree):
    params = [SamplingParams(temperature=0.8, top_k=50, seed=i, **PENALIZED) for i in range(3)]
    plain = SpecEngine(model, kv_cache_tokens=2048).generate(PROMPTS, params)
    engine = SpecEngine(model, {"type": "draft_model", "path": str(tiny_target), "kv_cache_tokens": 2048},
                        TREES[tree], {"type": "rejection"}, kv_cache_tokens=2048)
    assert [o.token_ids for o in engine.generate(PROMPTS, params)] == [o.token_ids for o in plain]


def test_min_tokens_holds_back_stop_tokens(model, tiny_target):
    params = SamplingParams(temperature=0.0, max_tokens=20, logit_bias={5: 100.0}, stop_token_ids=[5], min_tokens=6)
    plain = SpecEngine(model, kv_cache_tokens=2048).generate(PROMPTS, params)
    spec = SpecEngine(model, {"type": "draft_model", "path": str(tiny_target), "kv_cache_tokens": 2048},
                      TREES["chain"], {"type": "greedy"}, kv_cache_tokens=2048).generate(PROMPTS, params)
    for out in plain + spec:
        assert len(out.token_ids) == 7 and out.token_ids[-1] == 5 and 5 not in out.token_ids[:-1]
        assert out.finish_reason == "stop"
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


def test_stop_strings_wait_for_min_tokens(tiny_target):
    engine = SpecEngine(tiny_target, kv_cache_tokens=2048, device="cpu", dtype="float32")
    greedy = dict(temperature=0.0, max_tokens=20, ignore_eos=True)
    free = engine.generate("def main():", SamplingParams(**greedy))[0]
    stop = engine.decode(free.token_ids[1:3])
    early = engine.generate("def main():", SamplingParams(stop=stop, **greedy))[0]
    late = engine.generate("def main():", SamplingParams(stop=stop, min_tokens=8, **greedy))[0]
    assert len(early.token_ids) <= 3 and free.text.startswith(early.text)
    assert len(late.token_ids) >= 8 and late.token_ids == free.token_ids[: len(late.token_ids)]


@pytest.mark.parametrize("longer", [False, True])
def test_a_stop_string_that_ends_within_min_tokens_does_not_stop(tiny_target, longer):
    """vLLM (v1/engine/detokenizer.py) checks stop strings only once more than min_tokens tokens
    were generated, and only in the text that came after the min_tokens-th token, as min_tokens
    holds stop tokens back until then: one completed by token min_tokens or earlier never stops
    (a shorter stop string beside a longer one neither)."""
    engine = SpecEngine(tiny_target, kv_cache_tokens=2048, device="cpu", dtype="float32")
    greedy = dict(temperature=0.0, max_tokens=20, ignore_eos=True)
    free = engine.generate("def main():", SamplingParams(**greedy))[0]
    k, stop = next((i + 1, s) for i, s in enumerate(engine.decode([t]) for t in free.token_ids)
                   if s.isprintable() and "\ufffd" not in s and free.text.count(s) == 1)
    stops = [stop, "a stop string it never writes"] if longer else [stop]
    assert len(engine.generate("def main():", SamplingParams(stop=stops, min_tokens=k - 1, **greedy))[0].token_ids) == k
    held = engine.generate("def main():", SamplingParams(stop=stops, min_tokens=k, **greedy))[0]
    assert held.token_ids == free.token_ids and held.text == free.text and held.finish_reason == "length"


@pytest.mark.parametrize("bad", [dict(frequency_penalty=1e39), dict(presence_penalty=-1e39), dict(logit_bias={3: 1e39}),
                                 dict(repetition_penalty=1e-46)])
def test_values_the_float32_logits_cannot_hold_are_refused(bad):
    """A penalty past float32's range becomes inf in the logits' arithmetic, and inf x a count of
    0 is NaN at every token (a repetition penalty rounding to 0 divides by it): the request
    would decode token 0 after token 0. They are refused, naming the field."""
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(max_tokens=8, **bad)
    for ok in (dict(frequency_penalty=2.0, presence_penalty=-2.0, logit_bias={3: 100.0}, repetition_penalty=1e-3),
               dict(frequency_penalty=3e38, repetition_penalty=1e-30)):
        SamplingParams(max_tokens=8, **ok)


def test_stop_token_ids_outside_the_vocabulary_are_refused(tiny_target):
    """min_tokens holds stop tokens back by indexing [B, V] tensors with their ids: one past the
    vocabulary made every later step raise IndexError (on CUDA a device-side assert), a negative
    one held back token V - 1 instead. The engine refuses them as it refuses such logit_bias ids."""
    engine = SpecEngine(tiny_target, kv_cache_tokens=256, device="cpu", dtype="float32")
    for bad in (320, -1):
        with pytest.raises(ValueError, match=f"stop_token_ids token id {bad} is not in"):
            engine.add_request([1, 2], SamplingParams(stop_token_ids=[5, bad], min_tokens=2, max_tokens=4))
    assert not engine.has_unfinished()
    assert len(engine.generate([[1, 2]], SamplingParams(stop_token_ids=[5], min_tokens=2, max_tokens=4))[0].token_ids) >= 3


def check_every_gather(engine: SpecEngine, monkeypatch) -> list[int]:
    """Make each of ``engine``'s gathers check that its Penalties equal ``Penalties.build`` of the
    batch's histories and that only running requests with adjustments hold rows; returns the list
    of checked batches' sizes, which grows as they run."""
    checked, gather = [], engine._adjustments.gather

    def checking(request_ids, rows):
        got = gather(request_ids, rows)
        want = Penalties.build(rows, engine.model.config.vocab_size, engine.device)
        for name in FIELDS:
            torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=0, atol=0, msg=name)
        running = {r.id for r in engine.scheduler.running if r.params.adjusts_logits}
        holding = set(engine._adjustments.slots)
        assert holding <= running and set(request_ids) & running <= holding
        checked.append(len(rows))
        return got

    monkeypatch.setattr(engine._adjustments, "gather", checking)
    return checked


def test_the_state_on_the_device_equals_a_build_from_each_history(model, tiny_target, monkeypatch):
    """A mixed run (speculative steps and plain ones above spec_max_batch_size, preemptions of a
    small KV pool, aborts, stop strings and tokens, requests with and without adjustments): every
    step's adjustments, kept on the device and updated with each step's commits, equal a build
    from scratch, and no request keeps its rows after it ends."""
    engine = SpecEngine(model, {"type": "draft_model", "path": str(tiny_target), "kv_cache_tokens": 2048},
                        TREES["chain"], {"type": "rejection"}, tokenizer=load_tokenizer(tiny_target),
                        kv_cache_tokens=100, max_batch_size=4, spec_max_batch_size=3)
    checked = check_every_gather(engine, monkeypatch)
    calls = collections.Counter()
    for key, owner, name in (("preempt", engine.scheduler, "preempt"), ("plain", engine._plain, "step"),
                             ("speculative", engine._spec, "step")):
        monkeypatch.setattr(owner, name, counted(getattr(owner, name), calls, key))
    common = dict(max_tokens=40, ignore_eos=True)
    params = [SamplingParams(temperature=0.0, **common),
              SamplingParams(temperature=0.8, seed=1, frequency_penalty=1.5, presence_penalty=0.5, **common),
              SamplingParams(temperature=0.0, repetition_penalty=2.0, stop=["e"], min_tokens=3, **common),
              SamplingParams(temperature=0.8, seed=2, max_tokens=40, logit_bias={7: 3.0, 42: -100.0}, min_tokens=10,
                             stop_token_ids=[5]),
              SamplingParams(temperature=0.0, speculative=False, frequency_penalty=1.0, repetition_penalty=1.3,
                             **common),
              SamplingParams(temperature=0.8, seed=3, presence_penalty=1.0, logit_bias={9: 2.0}, stop=["a"], **common)]
    ids = [engine.add_request(PROMPTS[i % 3], p) for i, p in enumerate(params * 2)]
    stops = {i for i, p in zip(ids, params * 2) if p.stop}
    outs, aborted = {}, [ids[1], ids[9]]
    for step in itertools.count():
        if not engine.has_unfinished():
            break
        outs.update((o.request_id, o) for o in engine.step())
        if step == 6:
            assert aborted[0] in engine._adjustments.slots and aborted[1] not in engine._adjustments.slots  # (waiting)
            for i in aborted:
                engine.abort(i)
    assert not engine._adjustments.slots and len(checked) > 50
    assert set(outs) == set(ids) - set(aborted) and any(outs[i].finish_reason == "stop" for i in stops)
    assert calls["preempt"] and calls["plain"] and calls["speculative"]


def test_no_rows_outlive_their_requests(model, monkeypatch):
    """Requests let go of their rows however they end: stopped by their first token (the
    prefill's), at max_tokens, aborted with a step in flight or while waiting; requests without
    adjustments never hold any, and a later request takes a slot let go of."""
    engine = SpecEngine(model, kv_cache_tokens=2048, max_batch_size=2)
    checked = check_every_gather(engine, monkeypatch)
    penalized = dict(temperature=0.0, max_tokens=8, ignore_eos=True, frequency_penalty=0.5)
    params = [SamplingParams(temperature=0.0, max_tokens=8, logit_bias={5: 100.0}, stop_token_ids=[5]),
              SamplingParams(**dict(penalized, max_tokens=1)), SamplingParams(**penalized),
              SamplingParams(temperature=0.0, max_tokens=8), SamplingParams(**penalized)]
    first, one, running, plain, waiting = [engine.add_request(p, sp) for p, sp in zip(PROMPTS + PROMPTS, params)]
    assert [o.request_id for o in engine.step()] == [first, one] and not engine._adjustments.slots
    engine.step()
    assert set(engine._adjustments.slots) == {running} and engine._plain.in_flight.rows.keys() == {running, plain}
    engine.abort(running)
    engine.abort(waiting)
    assert not engine._adjustments.slots
    assert engine.generate(PROMPTS, SamplingParams(**penalized))
    assert not engine._adjustments.slots and len(engine._adjustments.free) == 3  # (row 0 and 3 slots, grown once)
    assert len(engine._adjustments.counts) == 4
    assert checked
