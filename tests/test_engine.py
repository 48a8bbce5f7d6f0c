"""SpecEngine with plain decoding: equal to transformers, batching-invariant, stop handling, KV pressure."""

import dataclasses
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from specflow import SamplingParams, SpecEngine
from specflow.config import ConfigError
from specflow.pipeline import EngineConfig
from specflow.registry import TREE_BUILDERS, VERIFIERS
from specflow.tree import Expansion, Frontier, ancestor_mask
from tests.stateless import StatelessDrafter
from tests.test_chunked_prefill import prefill_sizes

PROMPTS = [[5, 17, 99, 3, 42, 8, 1, 77, 23], [9, 31, 7, 120, 56], [200, 4, 4, 4, 13, 250, 11, 2, 90, 91, 92, 300]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def engine(tiny_target):
    return SpecEngine(tiny_target, device="cpu", dtype="float32")


def test_greedy_equals_transformers_generate(engine, tiny_target):
    hf = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    outs = engine.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, outs):
        ids = torch.tensor([prompt])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24,
                          min_new_tokens=24, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids == ref
        assert out.finish_reason == "length" and out.accept_lengths == [1] * 23  # first token comes from prefill


def test_batched_equals_one_at_a_time(engine):
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (5, 30, 12)]
    together = engine.generate(PROMPTS, params)
    alone = [engine.generate([p], sp)[0] for p, sp in zip(PROMPTS, params)]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert [len(o.token_ids) for o in together] == [5, 30, 12]


def test_requests_join_between_steps(engine):
    alone = [engine.generate([p], GREEDY)[0].token_ids for p in PROMPTS]
    first = engine.add_request(PROMPTS[0], GREEDY)
    outputs = {}
    for _ in range(5):
        outputs.update({o.request_id: o for o in engine.step()})
    later = [engine.add_request(p, GREEDY) for p in PROMPTS[1:]]
    while engine.has_unfinished():
        outputs.update({o.request_id: o for o in engine.step()})
    assert [outputs[i].token_ids for i in [first, *later]] == alone


def test_seeded_sampling_is_reproducible(engine):
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
    a = engine.generate(PROMPTS, params)
    b = engine.generate(PROMPTS, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    unseeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    assert engine.generate(PROMPTS[:1], unseeded)[0].token_ids != engine.generate(PROMPTS[:1], unseeded)[0].token_ids


def test_text_in_text_out_and_stop_string(engine):
    free = engine.generate("def main():", GREEDY)[0]
    assert free.text == engine.decode(free.token_ids)
    half = len(free.text) // 2  # a stop string of whole characters (a random model writes invalid bytes too)
    stop = next(w for i in range(half, len(free.text) - 2) if "\ufffd" not in (w := free.text[i:i + 3]) and w.strip())
    cut = engine.generate("def main():", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop]))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.index(stop)]
    assert free.token_ids[: len(cut.token_ids)] == cut.token_ids
    assert stop in engine.decode(cut.token_ids) and stop not in engine.decode(cut.token_ids[:-1])


def test_stop_token_ids_and_eos(engine):
    free = engine.generate(PROMPTS[:1], GREEDY)[0].token_ids
    tok = free[5]
    out = engine.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[tok]))[0]
    assert out.token_ids == free[: free.index(tok) + 1] and out.finish_reason == "stop"
    # the stop token's text is left out, as vLLM leaves it out
    assert out.text == engine.decode(out.token_ids[:-1]) != engine.decode(out.token_ids)
    engine.eos_token_ids, saved = [tok], engine.eos_token_ids
    try:
        eos = engine.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=24))[0]
        ignored = engine.generate(PROMPTS[:1], GREEDY)[0]
    finally:
        engine.eos_token_ids = saved
    assert eos.token_ids == out.token_ids and len(ignored.token_ids) == 24


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_kv_pressure_queues_and_preempts_without_changing_results(tiny_target, engine, sampled):
    """(Seeded: a preempted request resumes on its generator where it left it.)"""
    params = [SamplingParams(temperature=0.8, max_tokens=24, seed=i, ignore_eos=True) for i in range(6)] \
        if sampled else GREEDY
    expected = [o.token_ids for o in engine.generate(PROMPTS * 2, params)]
    small = SpecEngine(tiny_target, device="cpu", dtype="float32", kv_cache_tokens=80, page_size=4)
    outs = small.generate(PROMPTS * 2, params)
    assert [o.token_ids for o in outs] == expected
    assert small.runner.cache.num_pages_used == 0
    with pytest.raises(ValueError, match="does not fit in the KV cache"):
        small.add_request(list(range(1, 100)), GREEDY)


def test_a_prefill_bound_spreads_prompts_over_steps_in_chunks_without_changing_results(tiny_target, engine):
    expected = [o.token_ids for o in engine.generate(PROMPTS * 2, GREEDY)]
    bounded = SpecEngine(engine.model, {"type": "ngram"}, tokenizer=engine.tokenizer, max_prefill_tokens=10)
    sizes = prefill_sizes(bounded)
    assert [o.token_ids for o in bounded.generate(PROMPTS * 2, GREEDY)] == expected
    prefilled = [sum(step) for step in sizes]
    # prompts of 9, 5, 12, 9, 5, 12 tokens, each step filled up to the bound by the next chunks:
    # 9 + 1 of 5; 4 + 6 of 12; 6 + 4 of 9; 5 + 5; 10 of 12; 2
    assert prefilled == [10, 10, 10, 10, 10, 2]


def test_a_generate_that_raises_leaves_none_of_its_requests_behind(engine, monkeypatch):
    """A refused prompt after accepted ones, or an interrupt between steps: the requests the call
    added are aborted (nobody would claim them; they ran on in later calls, their outputs piling
    up unreturned), while a request added before with add_request keeps running."""
    before = engine.add_request(PROMPTS[0], GREEDY)
    with pytest.raises(ValueError, match="the prompt is empty"):
        engine.generate([PROMPTS[1], []], GREEDY)
    assert [r.id for r in engine.scheduler.waiting] == [before]
    step, steps = engine.step, []

    def interrupted():
        steps.append(1)
        if len(steps) == 3:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(engine, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.generate(PROMPTS[1:], GREEDY)
    monkeypatch.undo()
    assert [r.id for r in engine.scheduler.running + list(engine.scheduler.waiting)] == [before]
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [o.request_id for o in outs] == [before] and engine.runner.cache.num_pages_used == 0


def test_tree_builders_and_verifiers_get_the_engine_s_context(tiny_target, monkeypatch):
    """The registry's contract: a tree builder's and a verifier's from_config get the context a
    drafter's does (they were built once with none, when the config was checked)."""
    seen = {}

    def recording(name, build):
        def from_config(cls, cfg, **ctx):
            seen[name] = ctx
            return build(cls, cfg, **ctx)
        return classmethod(from_config)

    for registry, name in ((TREE_BUILDERS, "chain"), (VERIFIERS, "greedy")):
        cls = registry.get(name)[0]
        monkeypatch.setattr(cls, "from_config", recording(name, cls.from_config.__func__))
    SpecEngine(tiny_target, {"type": "ngram"}, {"type": "chain"}, {"type": "greedy"}, device="cpu", dtype="float32")
    assert set(seen) == {"chain", "greedy"}
    for ctx in seen.values():
        assert ctx["vocab_size"] == 320 and ctx["device"] == torch.device("cpu") and "target" in ctx


@dataclasses.dataclass
class LearningDrafter(StatelessDrafter):
    """A dataclass (unhashable: eq without frozen) that learns across requests, as a researcher
    writes one: its requests' coin walks are salted apart by identity."""

    learns_across_requests: bool = True

    def expand(self, frontier: Frontier) -> Expansion:
        b, f = frontier.nodes.shape
        return Expansion(torch.zeros(b, f, frontier.k, dtype=torch.long), torch.full((b, f, frontier.k), -torch.inf))


def test_a_dataclass_drafter_that_learns_across_requests_salts_its_requests(tiny_target):
    drafter = LearningDrafter()
    engines = [SpecEngine(tiny_target, drafter, {"type": "chain", "depth": 2}, {"type": "greedy"}, device="cpu",
                          dtype="float32") for _ in range(2)]
    rids = [e.add_request(PROMPTS[0], SamplingParams(max_tokens=2)) for e in engines for _ in range(2)]
    salts = [e._requests[r].salt for e, r in zip([engines[0]] * 2 + [engines[1]] * 2, rids)]
    assert salts == [1, 2, 3, 4]


class EmptyDrafter(StatelessDrafter):
    """Drafts nothing and says so with ``len``: an object that is falsy, and still a drafter."""

    def __len__(self) -> int:
        return 0

    def expand(self, frontier: Frontier) -> Expansion:
        b, f = frontier.nodes.shape
        return Expansion(torch.zeros(b, f, frontier.k, dtype=torch.long), torch.full((b, f, frontier.k), -torch.inf))


def test_a_falsy_drafter_is_a_drafter(tiny_target):
    """The scheduler keeps room for trees of a drafter whose ``len`` is 0 (it was taken for no
    drafter: admission made room for the root alone)."""
    e = SpecEngine(tiny_target, EmptyDrafter(), {"type": "chain", "depth": 3}, {"type": "greedy"},
                   device="cpu", dtype="float32")
    assert e.scheduler.num_draft_tokens == 4
    assert [len(o.token_ids) for o in e.generate(PROMPTS, GREEDY)] == [24] * 3


def test_from_config_uses_components_already_built_as_they_are(tiny_target):
    verifier = VERIFIERS.get("greedy")[0].from_config(VERIFIERS.get("greedy")[1]())
    engine = SpecEngine.from_config(EngineConfig(target=str(tiny_target), drafter={"type": "ngram"},
                                                 verifier=verifier, device="cpu", dtype="float32"))
    assert engine.verifier is verifier


@pytest.mark.parametrize("override, message", [
    ("engine.tree.topk=0", r"^engine\.tree: .*topk must be >= 1"),
    ("engine.drafter.type=nope", r"^engine\.drafter\.type: unknown drafter type 'nope'"),
    ("engine.page_size=0", r"^engine\.page_size must be >= 1"),
])
def test_a_yaml_s_bad_engine_value_is_named_from_the_file_s_root(override, message):
    """Errors of an engine built from a YAML name the key as the file has it (engine.tree, ...),
    as an experiment's name pipelines[name].tree, before the target loads."""
    with pytest.raises(ConfigError, match=message):
        SpecEngine.from_yaml(ROOT / "configs" / "serve.yaml", [override, "engine.target=/no/such/target"])


def test_an_experiment_yaml_builds_the_pipeline_it_names():
    """An experiment's engine section alone is plain decoding: from_yaml asks which pipeline (its
    drafter, tree and verifier join the engine), rather than silently building the baseline."""
    quickstart = ROOT / "configs" / "quickstart.yaml"
    with pytest.raises(ConfigError, match=r"is an experiment: pass pipeline= one of ngram-chain, .*, baseline"):
        SpecEngine.from_yaml(quickstart)
    with pytest.raises(ConfigError, match=r"pipeline: 'nope' is not one of ngram-chain, "):
        SpecEngine.from_yaml(quickstart, pipeline="nope")
    engine = SpecEngine.from_yaml(quickstart, ["pipelines.2.tree.topk=2", "engine.kv_cache_tokens=2048"],
                                  pipeline="eagle-eagle2")
    assert engine.pipeline.describe() == "eagle x eagle2 x rejection" and engine.tree_builder.topk == 2
    assert SpecEngine.from_yaml(quickstart, pipeline="baseline").drafter is None
    with pytest.raises(ConfigError, match="has no pipelines"):
        SpecEngine.from_yaml(ROOT / "configs" / "serve.yaml", pipeline="baseline")


def test_an_experiment_s_baseline_is_plain_decoding_whatever_the_engine_section_says():
    """An override cannot turn an experiment's baseline speculative: pipeline="baseline" is plain
    decoding, as an experiment's run measures it."""
    from specflow.pipeline import engine_config_from_yaml

    quickstart = ROOT / "configs" / "quickstart.yaml"
    assert engine_config_from_yaml(quickstart, ["engine.drafter={type: ngram}"], "baseline").drafter is None


@pytest.mark.parametrize("drafter", [{"type": "ngram", "scope": "global"}, {"type": "ngram"}, "draft_model"])
def test_one_drafter_serves_two_engines(tiny_target, drafter):
    """Drafters key their per-request state by request id: ids are unique across engines, so two
    engines sharing one drafter (a global n-gram trie learning from both) keep apart requests
    that each engine would number first."""
    drafter = {"type": "draft_model", "path": str(tiny_target)} if drafter == "draft_model" else drafter
    a = SpecEngine(tiny_target, drafter, {"type": "chain", "depth": 3}, {"type": "greedy"}, device="cpu",
                   dtype="float32")
    b = SpecEngine(a.model, a.drafter, {"type": "chain", "depth": 3}, {"type": "greedy"}, tokenizer=a.tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    rids = [a.add_request(PROMPTS[0], params), b.add_request(PROMPTS[1], params)]
    assert rids[0] != rids[1]
    outs = {}
    while a.has_unfinished() or b.has_unfinished():
        for e in (a, b):
            if e.has_unfinished():
                outs |= {o.request_id: o.token_ids for o in e.step()}
    plain = SpecEngine(a.model, tokenizer=a.tokenizer).generate(PROMPTS[:2], params)
    assert [outs[rid] for rid in rids] == [o.token_ids for o in plain]


def test_abort_frees_pages(engine):
    rid = engine.add_request(PROMPTS[0], GREEDY)
    engine.step()
    assert engine.runner.cache.num_pages_used > 0
    engine.abort(rid)
    assert engine.runner.cache.num_pages_used == 0 and not engine.has_unfinished()


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -1}, "temperature"), ({"top_k": 0}, "top_k"), ({"top_p": 0}, "top_p"),
    ({"min_p": 2}, "min_p"), ({"max_tokens": 0}, "max_tokens"), ({"stop": [""]}, "stop"),
    ({"stop": 5}, "stop must be a string or a list of non-empty strings, got 5"),
    ({"temperature": "hot"}, "temperature must be a number, got 'hot'"),
    ({"max_tokens": 2.5}, "max_tokens must be an integer, got 2.5"), ({"seed": True}, "seed must be an integer or None"),
    ({"stop_token_ids": [1, "a"]}, "stop_token_ids must be a list of token ids"),
])
def test_sampling_params_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_prompt_errors(engine):
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(ValueError, match="context length"):
        engine.add_request([1] * 10, SamplingParams(max_tokens=10_000))


def test_a_prompt_fits_the_kv_cache_only_with_room_for_the_token_after_it(tiny_target):
    """add_request refuses a prompt the whole pool could never prefill with its first token
    (the prompt's K/V plus one): such a request would wait forever; one token shorter runs."""
    e = SpecEngine(tiny_target, device="cpu", dtype="float32", kv_cache_tokens=32)
    with pytest.raises(ValueError, match="does not fit in the KV cache"):
        e.add_request(list(range(1, 33)), SamplingParams(max_tokens=1))
    assert not e.has_unfinished()
    out = e.generate([list(range(1, 32))], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"


def test_a_target_without_tokenizer_refuses_text_work_by_name(engine):
    """Token ids in, token ids out; stop strings (matched on text) would silently never stop, so
    they are refused, and so is decode (not an AttributeError)."""
    bare = SpecEngine(engine.model, tokenizer=None)
    out = bare.generate([PROMPTS[0]], GREEDY)[0]
    assert out.text is None and out.token_ids == engine.generate([PROMPTS[0]], GREEDY)[0].token_ids
    with pytest.raises(ValueError, match="stop strings need a tokenizer.*stop_token_ids"):
        bare.add_request(PROMPTS[0], SamplingParams(max_tokens=4, stop=["\n"]))
    with pytest.raises(ValueError, match="no tokenizer"):
        bare.decode([1, 2])
    assert not bare.has_unfinished()


# ---- regressions found in review -------------------------------------------------------------

def test_a_full_drafter_pool_falls_back_to_plain_steps(tiny_target, engine):
    prompt = list(range(1, 41))
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    small = SpecEngine(tiny_target, {"type": "draft_model", "path": str(tiny_target), "kv_cache_tokens": 64},
                       {"type": "chain", "depth": 3}, {"type": "greedy"}, device="cpu", dtype="float32",
                       kv_cache_tokens=4096)
    out = small.generate([prompt], params)[0]
    assert out.token_ids == engine.generate([prompt], params)[0].token_ids
    assert max(out.accept_lengths) > 1 and out.accept_lengths[-1] == 1  # drafted early, then plain


def test_a_pool_without_room_for_a_tree_verifies_the_roots_instead_of_stopping(tiny_target, engine):
    """A lone request whose pool holds its whole sequence but no longer a 16-node tree on top
    decodes plainly to the end, as plain decoding would, instead of stopping at "length"."""
    prompt, params = PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    e = SpecEngine(tiny_target, {"type": "draft_model", "path": str(tiny_target)}, {"type": "chain", "depth": 15},
                   {"type": "greedy"}, device="cpu", dtype="float32", kv_cache_tokens=len(prompt) + 30)
    out = e.generate([prompt], params)[0]
    assert out.token_ids == engine.generate([prompt], params)[0].token_ids
    assert max(out.accept_lengths) > 1 and out.accept_lengths[-1] == 1  # drafted while the pool had room


def test_a_preempted_request_that_can_never_fit_again_stops(tiny_target):
    e = SpecEngine(tiny_target, {"type": "draft_model", "path": str(tiny_target)}, {"type": "chain", "depth": 15},
                   {"type": "greedy"}, device="cpu", dtype="float32", kv_cache_tokens=64, max_batch_size=2)
    outs = e.generate([[1], list(range(2, 42))],
                      [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, speculative=False),
                       SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)])
    assert outs[0].finish_reason == "length" and len(outs[0].token_ids) == 30
    assert outs[1].finish_reason == "length" and len(outs[1].token_ids) < 40
    assert e.runner.cache.num_pages_used == 0 and not e.has_unfinished()


def test_generate_keeps_outputs_of_requests_added_before(engine):
    early = engine.add_request(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=1))
    outs = engine.generate(PROMPTS[1:], GREEDY)
    assert [len(o.token_ids) for o in outs] == [24, 24]
    assert engine.has_unfinished()  # (a `while has_unfinished(): step()` loop collects it)
    assert [o.request_id for o in engine.step()] == [early] and not engine.has_unfinished()
    with pytest.raises(ValueError, match="2 prompts but 1 SamplingParams"):
        engine.generate(PROMPTS[:2], [GREEDY])


def test_stop_string_across_a_split_character(engine):
    from specflow.request import Request

    ids = engine.tokenizer.convert_tokens_to_ids(["a", "b", "Ã", "©", "c"])  # byte-level: "é" is two tokens
    assert engine.decode(ids) == "abéc"
    for chunks in ([ids[:1], ids[1:2], ids[2:3], ids[3:4], ids[4:]], [ids]):  # token by token, or one step
        req = Request(0, [1], SamplingParams(stop=["bé"], max_tokens=10), [], engine.tokenizer)
        for chunk in chunks:
            req.append(chunk)
        assert req.finished and req.output().text == "a"


class CountingDrafter:
    """A real n-gram drafter that counts the engine's begin / release calls per request."""

    def __init__(self):
        from drafters.ngram import NgramDrafter

        self.inner, self.calls = NgramDrafter(), []
        self.needs = self.inner.needs

    def begin(self, features):
        self.calls += [("begin", r) for r in features.request_ids]
        self.inner.begin(features)

    def expand(self, frontier):
        return self.inner.expand(frontier)

    def commit(self, verdict, features):
        self.inner.commit(verdict, features)

    def release(self, request_ids):
        self.calls += [("release", r) for r in request_ids]
        self.inner.release(request_ids)


def test_drafter_begin_and_release_pair_up(tiny_target):
    drafter = CountingDrafter()
    e = SpecEngine(tiny_target, drafter, {"type": "chain", "depth": 2}, {"type": "greedy"}, device="cpu",
                   dtype="float32", kv_cache_tokens=4096)
    a = e.add_request(PROMPTS[0], SamplingParams(max_tokens=1))          # finishes inside prefill
    b = e.add_request(PROMPTS[1], GREEDY)
    e.step()
    e.abort(b)
    e.abort(b)
    assert drafter.calls == [("begin", b), ("release", b)] and ("begin", a) not in drafter.calls


def test_backend_choices(tiny_target):
    with pytest.raises(ValueError, match="backend: 'flash' is not one of torch, flashinfer, auto"):
        SpecEngine(tiny_target, device="cpu", backend="flash")
    assert type(SpecEngine(tiny_target, device="cpu").runner.attn).__name__ == "TorchBackend"  # auto on a CPU


# ---- plain decoding runs one step ahead of the host (specflow.overlap) ---------------------

def test_decoding_ahead_wastes_a_row_only_after_a_stop(engine, monkeypatch):
    """In one batch, a request stops on a stop token, one reaches max_tokens and one is aborted
    while its step is in flight: the others' outputs equal their runs alone, the stopped request
    costs one dropped row, and no request is launched past max_tokens."""
    free = engine.generate(PROMPTS[:1], GREEDY)[0].token_ids
    stop = free[5]
    stop_at = free.index(stop)
    alone = [engine.generate([p], GREEDY)[0].token_ids for p in PROMPTS[1:]]
    rows: dict[int, int] = {}
    extend = engine.runner.extend

    def counting(ids, tokens, **kw):
        if isinstance(tokens, torch.Tensor):  # decode steps ([B, 1] roots); prefills pass lists
            for r in ids:
                rows[r] = rows.get(r, 0) + 1
        return extend(ids, tokens, **kw)

    monkeypatch.setattr(engine.runner, "extend", counting)
    params = [SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop]), GREEDY,
              SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True), GREEDY]
    stopped, full, short, aborted = [engine.add_request(p, sp) for p, sp in zip(PROMPTS + PROMPTS[1:2], params)]
    outputs = {}
    for i in range(30):
        outputs.update({o.request_id: o for o in engine.step()})
        if i == 3:
            engine.abort(aborted)
    assert not engine.has_unfinished() and aborted not in outputs
    assert outputs[stopped].token_ids == free[: stop_at + 1] and outputs[stopped].finish_reason == "stop"
    assert outputs[full].token_ids == alone[0] and outputs[short].token_ids == alone[1][:7]
    # the first token of each comes from the prefill
    assert rows[stopped] == stop_at + 1 and rows[full] == 23 and rows[short] == 6
    assert engine.runner.cache.num_pages_used == 0


def test_decoding_ahead_records_root_only_steps(tiny_target):
    from specflow.tree import DraftTree, Roots

    e = SpecEngine(tiny_target, device="cpu", dtype="float32", record_steps=True)
    out = e.generate([PROMPTS[0]], GREEDY)[0]
    assert [s.step for s in out.steps] == list(range(23)) and [s.bonus_token for s in out.steps] == out.token_ids[1:]
    for s, root in zip(out.steps, out.token_ids):
        tree = DraftTree.root_only(Roots([s.request_id], torch.tensor([root]), torch.tensor([0]), [[root]],
                                         [torch.Generator()], torch.tensor([True])))
        assert s.tree == tree.to_json()[0] and s.accepted == [0] and s.timings["verify"] > 0
    assert {s.batch_size for s in out.steps} == {1}


def test_step_records_say_how_many_requests_shared_the_step(tiny_target):
    """Two requests of different lengths run side by side, then the longer one alone: each
    record's batch_size is the step's, and the batch steps' records share their timings."""
    e = SpecEngine(tiny_target, {"type": "ngram"}, {"type": "chain", "depth": 2}, {"type": "greedy"},
                   device="cpu", dtype="float32", record_steps=True)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (6, 24)]
    short, long = e.generate(PROMPTS[:2], params)
    shared = len(short.steps)
    assert {s.batch_size for s in short.steps} == {s.batch_size for s in long.steps[:shared]} == {2}
    assert {s.batch_size for s in long.steps[shared:]} == {1}
    assert all(a.timings == b.timings for a, b in zip(short.steps, long.steps))


@pytest.mark.parametrize("drafter", ["draft_model", "ngram"])
def test_tried_depths_are_the_path_s_deepest_tested_draft_and_zero_where_nothing_was_drafted(tiny_target, drafter):
    """Three requests above spec_max_batch_size decode plainly until the first finishes; then the
    one that opted out verifies its root beside the other's tree (after one plain step of the two
    launched ahead). A step's tried depth is its accepted drafts, plus one where its last accepted
    node has children: 0 where the request drafted nothing (the target drafting itself always
    fills its chain of 3, so it tests a draft at depth 3 or rejects one before; an n-gram miss
    drafts nothing)."""
    node = {"type": drafter, "path": str(tiny_target)} if drafter == "draft_model" else {"type": "ngram"}
    e = SpecEngine(tiny_target, node, {"type": "chain", "depth": 3}, {"type": "greedy"}, device="cpu",
                   dtype="float32", spec_max_batch_size=2, record_steps=True)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, speculative=spec)
              for n, spec in ((6, True), (14, False), (30, True))]
    outs = e.generate(PROMPTS, params)
    steps = []  # (draft depth, whether the request speculated in the step) of every step
    for out, p in zip(outs, params):
        assert len(out.tried_depths) == len(out.accept_lengths) == len(out.steps)
        for depth, n, step in zip(out.tried_depths, out.accept_lengths, out.steps):
            last = step.accepted[-1]
            assert depth == len(step.accepted) - 1 + any(ok and parent == last for parent, ok
                                                         in zip(step.tree["parents"], step.tree["valid"]))
            assert n - 1 <= depth <= n and step.kept == n   # (the record keeps what the request kept)
            # (a plain step's record holds the root alone, a speculative step's a tree of 4 nodes)
            steps.append((depth, p.speculative and len(step.tree["depth"]) > 1))
    assert {speculated for _, speculated in steps} == {False, True}  # (both kinds of step ran)
    assert {d for d, speculated in steps if not speculated} == {0}
    tried = {d for d, speculated in steps if speculated}
    assert tried == {3} if drafter == "draft_model" else 0 in tried and max(tried) > 0


class BrokenDrafter(StatelessDrafter):
    """Proposes token ``token`` under every node, with q ``q_value`` everywhere when asked."""

    def __init__(self, token: int, q_value: float = 1.0):
        self.token, self.q_value = token, q_value

    def expand(self, frontier: Frontier) -> Expansion:
        b, f = frontier.nodes.shape
        q = torch.full((b, f, 320), self.q_value) if frontier.want_probs else None  # (the tiny target's V)
        return Expansion(torch.full((b, f, frontier.k), self.token), torch.full((b, f, frontier.k), -1.0), q)


@pytest.mark.parametrize("drafter, tree, message, check", [
    (BrokenDrafter(10_000), {"type": "chain", "depth": 2}, r"drafted token ids outside \[0, \d+\).*max 10000", True),
    (BrokenDrafter(-3), {"type": "chain", "depth": 2}, r"drafted token ids outside .*min -3", True),
    (BrokenDrafter(5, q_value=float("nan")), {"type": "chain", "depth": 2, "sample": True},
     "returned draft probabilities q with NaN, infinite or negative entries", True),
    # a tree on the host has its token ids checked without check_drafts too (no wait), not
    # left to the embedding's index error
    (BrokenDrafter(10_000), {"type": "chain", "depth": 2}, r"drafted token ids outside \[0, \d+\).*max 10000", False),
    (BrokenDrafter(-3), {"type": "static", "choices": [[0], [1], [0, 0]]}, r"drafted token ids outside .*min -3",
     False),
])
def test_check_drafts_names_the_drafter_that_broke_a_tree(tiny_target, drafter, tree, message, check):
    engine = SpecEngine(tiny_target, drafter, tree, {"type": "rejection"}, device="cpu", dtype="float32",
                        check_drafts=check)
    builder = type(engine.pipeline.tree).__name__
    with pytest.raises(ValueError, match=f"the BrokenDrafter drafter with the {builder} " + message):
        engine.generate([PROMPTS[0]], SamplingParams(temperature=0.8, max_tokens=4, seed=0))


class FloatTokensDrafter(StatelessDrafter):
    """Proposes token 5.7 under every node: ids in a float tensor, which a cast would truncate."""

    def expand(self, frontier: Frontier) -> Expansion:
        b, f = frontier.nodes.shape
        return Expansion(torch.full((b, f, frontier.k), 5.7), torch.full((b, f, frontier.k), -1.0))


def test_token_ids_of_a_float_dtype_are_refused_by_name(tiny_target):
    """The dtype is known on the host, so it is checked with check_drafts off too."""
    engine = SpecEngine(tiny_target, FloatTokensDrafter(), {"type": "chain", "depth": 2}, {"type": "greedy"},
                        device="cpu", dtype="float32")
    with pytest.raises(ValueError, match=r"FloatTokensDrafter.expand returned tokens of dtype torch.float32; "
                                         r"they are token ids: torch.long"):
        engine.generate([PROMPTS[0]], GREEDY)


class LogprobsDrafter(StatelessDrafter):
    """Proposes tokens 5, 6, ... under every node with log-probs ``logprobs`` (one per child)."""

    def __init__(self, logprobs: list[float]):
        self.logprobs = logprobs

    def expand(self, frontier: Frontier) -> Expansion:
        b, f = frontier.nodes.shape
        tokens = (5 + torch.arange(frontier.k)).expand(b, f, -1)
        return Expansion(tokens, torch.tensor(self.logprobs).expand(b, f, -1))


@pytest.mark.parametrize("logprobs, message", [
    ([float("nan"), -1.0], r"NaN log-probs"),
    ([0.5, -1.0], r"log-probs above 0 \(max 0\.5\)"),
    ([-2.0, -1.0], r"log-probs that do not descend along k"),
])
def test_check_drafts_refuses_log_probs_a_builder_would_misread(tiny_target, logprobs, message):
    """A NaN log-prob reads as "no child" and one above 0 is clamped, so without check_drafts the
    drafter just looks weak (output unchanged); with it, each expansion is refused by name."""
    tree = {"type": "static", "choices": [[0], [1], [0, 0], [0, 1]]}
    plain = SpecEngine(tiny_target, device="cpu", dtype="float32").generate(PROMPTS[:2], GREEDY)
    weak = SpecEngine(tiny_target, LogprobsDrafter(logprobs), tree, {"type": "greedy"}, device="cpu",
                      dtype="float32").generate(PROMPTS[:2], GREEDY)
    assert [o.token_ids for o in weak] == [o.token_ids for o in plain]
    checked = SpecEngine(tiny_target, LogprobsDrafter(logprobs), tree, {"type": "greedy"}, device="cpu",
                         dtype="float32", check_drafts=True)
    with pytest.raises(ValueError, match="LogprobsDrafter.expand returned " + message):
        checked.generate(PROMPTS[:2], GREEDY)


class MisshapenQDrafter(StatelessDrafter):
    """Proposes token 5 under every node, with a q of shape ``shape(b, f)`` when asked."""

    def __init__(self, shape):
        self.shape = shape

    def expand(self, frontier: Frontier) -> Expansion:
        b, f = frontier.nodes.shape
        q = torch.full(self.shape(b, f), 0.01) if frontier.want_probs else None
        return Expansion(torch.full((b, f, frontier.k), 5), torch.full((b, f, frontier.k), -1.0), q)


@pytest.mark.parametrize("check", [False, True])
@pytest.mark.parametrize("shape, message", [
    (lambda b, f: (b, f, 313), r"the MisshapenQDrafter drafter with the ChainBuilder returned draft probabilities "
                               r"q over 313 tokens; the target's vocabulary has 320"),
    (lambda b, f: (b, f, 327), r"q over 327 tokens; the target's vocabulary has 320"),
    (lambda b, f: (b, 320), r"MisshapenQDrafter.expand returned probs \(1, 320\); the frontier asks for \[B, F, V\]"),
])
def test_a_q_of_the_wrong_shape_is_named_with_its_drafter(tiny_target, shape, message, check):
    """q's shape is the drafter's answer too: a width other than the vocabulary's (a verifier's
    broadcast error or, wider, an out-of-vocabulary draw reaching the embedding) and a missing
    frontier axis are named like tokens and logprobs of the wrong shape, check_drafts or not."""
    engine = SpecEngine(tiny_target, MisshapenQDrafter(shape), {"type": "chain", "depth": 2, "sample": True},
                        {"type": "rejection"}, device="cpu", dtype="float32", check_drafts=check)
    with pytest.raises(ValueError, match=message):
        engine.generate([PROMPTS[0]], SamplingParams(temperature=0.8, max_tokens=4, seed=0))


def _shifted(field: str, by: int):
    """A chain builder whose trees have ``field`` of the root moved by ``by``, or are broken there."""
    from trees.chain import ChainBuilder

    class ShiftedRootChain(ChainBuilder):
        def build(self, drafter, roots):
            tree = super().build(drafter, roots)
            if field in ("valid", "valid parent"):  # the root invalid; node 1 invalid under valid node 2
                valid = tree.valid.clone()
                valid[:, 0 if field == "valid" else 1] = False
                return dataclasses.replace(tree, valid=valid)
            if field == "sampled":
                return dataclasses.replace(tree, sampled=tree.valid.clone())
            if field == "mask":
                mask = tree.mask.clone()
                mask[:, 1, 2] = True   # node 1 sees its child
                return dataclasses.replace(tree, mask=mask)
            if field == "node position":  # node 2 three places past its depth's
                return dataclasses.replace(tree, positions=tree.positions + torch.tensor([0, 0, 3]))
            if field == "depth":  # node 2 a level deeper than its parent's child, at that position
                bump = torch.tensor([0, 0, 1])
                return dataclasses.replace(tree, depth=tree.depth + bump, positions=tree.positions + bump)
            if field == "order":  # nodes 1 and 2 swapped, all else (mask included) kept consistent
                swap, old = torch.tensor([0, 2, 1]), tree.parents[:, [0, 2, 1]]
                parents = torch.where(old < 0, old, swap[old.clamp(min=0)])
                moved = {name: getattr(tree, name)[:, swap] for name in
                         ("tokens", "depth", "positions", "scores", "valid", "sampled")}
                return dataclasses.replace(tree, parents=parents, mask=ancestor_mask(parents), **moved)
            shifted = getattr(tree, field).clone()
            if field == "tokens":
                shifted[:, 0] += by
            else:   # positions: the whole tree, so its own positions still equal root + depth
                shifted += by
            return dataclasses.replace(tree, **{field: shifted})

    return ShiftedRootChain(depth=2)


@pytest.mark.parametrize("field, by, message", [
    ("positions", 1, r"built a tree whose root positions are \[\d+, \d+\]; the requests' roots"),
    ("positions", -2, r"built a tree whose root positions are"),
    ("tokens", 1, r"built a tree whose root tokens are \[\d+, \d+\]; the requests' roots"),
])
def test_check_drafts_refuses_a_tree_whose_root_is_not_the_requests(tiny_target, field, by, message):
    """A tree at the wrong positions (RoPE) or over the wrong root token is structurally sound and
    verifies without an error, but its greedy output is no longer plain decoding's: check_drafts
    names it."""
    engine = SpecEngine(tiny_target, {"type": "ngram"}, _shifted(field, by), {"type": "greedy"}, device="cpu",
                        dtype="float32", check_drafts=True)
    with pytest.raises(ValueError, match="the NgramDrafter drafter with the ShiftedRootChain " + message):
        engine.generate(PROMPTS[:2], GREEDY)


@pytest.mark.parametrize("field, by", [("positions", 1), ("tokens", 1)])
def test_a_wrong_root_on_the_host_is_refused_without_check_drafts(tiny_target, field, by):
    """A tree on the host has its root checked without check_drafts too (no wait): else it would
    change the output silently."""
    engine = SpecEngine(tiny_target, {"type": "ngram"}, _shifted(field, by), {"type": "greedy"}, device="cpu",
                        dtype="float32")
    message = rf"built a tree whose root {field} are \[\d+, \d+\]; the requests' roots"
    with pytest.raises(ValueError, match="the NgramDrafter drafter with the ShiftedRootChain " + message):
        engine.generate(PROMPTS[:2], GREEDY)


@pytest.mark.parametrize("check", [False, True])
@pytest.mark.parametrize("field, message", [
    ("valid", r"the root must be valid"),
    ("valid parent", r"a valid node's parent must be valid"),
    ("sampled", r"sampled nodes need draft_probs"),
    ("mask", r"mask must be the ancestor-or-self mask of parents"),
    ("node position", r"positions = root position \+ depth"),
    ("depth", r"depth = parent depth \+ 1"),
    ("order", r"every node but the root has a parent, before it"),
])
def test_a_tree_of_broken_structure_is_refused_by_name(tiny_target, field, message, check):
    """A tree on the host has its structure checked without check_drafts too (no wait): unchecked,
    a node's position other than its depth's verified without an error and changed every greedy
    output here, and other broken structures failed deep in a verifier or drafter. Each broken
    invariant is named (a message, not an empty assertion)."""
    engine = SpecEngine(tiny_target, {"type": "ngram"}, _shifted(field, 0), {"type": "greedy"}, device="cpu",
                        dtype="float32", check_drafts=check)
    with pytest.raises(ValueError, match="the NgramDrafter drafter with the ShiftedRootChain built an invalid "
                                         "draft tree: " + message):
        engine.generate(PROMPTS[:2], GREEDY)


def test_check_drafts_refuses_a_max_tries_below_the_walk_it_bounds(tiny_target):
    """A max_tries too low stops the rejection walk short: still lossless, so nothing else notices,
    but the drafts past it are never tried. check_drafts names it."""
    from trees.static import StaticBuilder

    class Stingy(StaticBuilder):
        def build(self, drafter, roots):
            return dataclasses.replace(super().build(drafter, roots), max_tries=1)

    tree = Stingy(choices=[[0], [1], [0, 0]])
    engine = SpecEngine(tiny_target, {"type": "draft_model", "path": str(tiny_target)}, tree, {"type": "rejection"},
                        device="cpu", dtype="float32", check_drafts=True)
    with pytest.raises(ValueError, match=r"the DraftModelDrafter drafter with the Stingy built a tree whose walk "
                                         r"from the root can try 2 children, but its max_tries is 1"):
        engine.generate([PROMPTS[0]], SamplingParams(temperature=0.8, max_tokens=4, seed=0))


class BrokenVerifier:
    """Exact match, then one mistake in the verdict (``bug``)."""

    lossless = True

    def __init__(self, bug: str):
        self.bug = bug

    def verify(self, tree, target_logits, sampling):
        from specflow.tree import Verdict
        from verifiers.walk import exact_match

        v = exact_match(tree, target_logits, sampling)
        if self.bug == "accept_len past the path":
            return Verdict(v.accepted, torch.full_like(v.accept_len, v.accepted.shape[1]), v.bonus_tokens)
        if self.bug == "not a path":  # node 2 (node 1's child in a chain) straight under the root
            accepted = v.accepted.clone()
            accepted[:, 1] = 2
            return Verdict(accepted, torch.ones_like(v.accept_len), v.bonus_tokens)
        if self.bug == "no root":
            return Verdict(v.accepted.roll(-1, 1), v.accept_len, v.bonus_tokens)
        if self.bug == "float indices":
            return Verdict(v.accepted.float(), v.accept_len.float(), v.bonus_tokens)
        return Verdict(v.accepted, v.accept_len, v.bonus_tokens + target_logits.shape[-1])  # bonus outside V


@pytest.mark.parametrize("bug, message, check", [
    ("accept_len past the path", r"returned accept_len (\d+) for request row 0, whose accepted path holds \1 entries",
     True),
    ("not a path", r"returned an accepted path \[0, 2\] \(accept_len 1\) for request row 0: node 2 is not a valid "
                   r"child of node 0", True),
    ("no root", r"returned an accepted path .* for request row 0: it must start at the root", True),
    ("bonus outside V", r"returned bonus token \d+ for request row 0, outside \[0, 320\)", True),
    # (dtypes are known on the host: refused with check_drafts off too)
    ("float indices", r"returned a verdict of dtypes accepted torch.float32, accept_len torch.float32, "
                      r"bonus_tokens torch.int64; .*torch.long", False),
])
def test_check_drafts_names_the_verifier_that_broke_a_verdict(tiny_target, bug, message, check):
    """A verdict that is no path of the tree failed deep in the KV commit ("keep must be
    increasing", a numpy broadcast error) or, with a bonus outside the vocabulary, was blamed on
    the drafter a step later (the bonus is the next root)."""
    engine = SpecEngine(tiny_target, {"type": "ngram"}, {"type": "chain", "depth": 2}, BrokenVerifier(bug),
                        device="cpu", dtype="float32", check_drafts=check)
    with pytest.raises(ValueError, match="the BrokenVerifier verifier " + message):
        engine.generate([PROMPTS[0] * 3], GREEDY)


def _broken_chain(bug: str):
    from trees.chain import ChainBuilder

    class BrokenChain(ChainBuilder):
        def build(self, drafter, roots):
            said, self.num_draft_tokens = self.num_draft_tokens, self.depth + 1  # (ChainBuilder sizes its tree by it)
            tree = super().build(drafter, roots)
            self.num_draft_tokens = said
            if bug == "no mask":
                tree.mask = None
                return tree
            if bug == "more nodes":   # N forgot the root: num_draft_tokens = depth
                return tree
            tree.draft_probs = tree.draft_probs.clone()   # "sampled, q = 0": node 1's token loses its mass
            rows = torch.arange(tree.batch_size)
            tree.draft_probs[rows, 0, tree.tokens[:, 1]] = 0.0
            return tree

    builder = BrokenChain(depth=2, sample=bug == "sampled, q = 0")
    if bug == "more nodes":
        builder.num_draft_tokens = 2
    return builder


@pytest.mark.parametrize("check", [False, True])
@pytest.mark.parametrize("bug, message", [
    ("no mask", r"returned a tree without its mask .* tree.with_mask\(\)"),
    ("more nodes", r"built trees of 3 nodes, but its num_draft_tokens is 2"),
])
def test_a_tree_without_mask_or_of_another_size_is_named_with_its_builder(tiny_target, bug, message, check):
    """Neither was caught: no mask failed in the target forward ('NoneType' object is not
    subscriptable), and a tree larger than num_draft_tokens ran until a batch mixed drafting and
    plain rows (a bare AssertionError in DraftTree.place)."""
    engine = SpecEngine(tiny_target, {"type": "ngram"}, _broken_chain(bug), {"type": "greedy"}, device="cpu",
                        dtype="float32", check_drafts=check)
    with pytest.raises(ValueError, match="the NgramDrafter drafter with the BrokenChain " + message):
        engine.generate([PROMPTS[0] * 3], GREEDY)


def test_check_drafts_refuses_a_sampled_node_whose_token_has_no_q(tiny_target):
    """The rejection rule accepts such a node whatever the target (u * 0 < p(x)): lossy, and
    only a chi-square saw it (p ~ 1e-291 through the engine)."""
    engine = SpecEngine(tiny_target, {"type": "ngram"}, _broken_chain("sampled, q = 0"), {"type": "rejection"},
                        device="cpu", dtype="float32", check_drafts=True)
    with pytest.raises(ValueError, match="the NgramDrafter drafter with the BrokenChain marked nodes sampled .* q = 0"):
        engine.generate([PROMPTS[0] * 3], SamplingParams(temperature=0.8, max_tokens=24, seed=0, ignore_eos=True))


def test_tried_depth_takes_any_integer_verdict():
    """check_verdict lets any integer dtype through; gather takes int32/int64 indices only."""
    from specflow.spec_step import tried_depth
    from specflow.tree import DraftTree, Verdict
    depth = torch.tensor([[0, 1, 2]])
    tree = DraftTree(tokens=torch.tensor([[5, 6, 7]]), parents=torch.tensor([[-1, 0, 1]]), depth=depth,
                     positions=depth + 3, scores=torch.ones(1, 3), valid=torch.ones(1, 3, dtype=torch.bool),
                     sampled=torch.zeros(1, 3, dtype=torch.bool))
    verdict = Verdict(torch.tensor([[0, 1, -1]], dtype=torch.int16), torch.tensor([1], dtype=torch.int16),
                      torch.tensor([9]))
    assert tried_depth(tree, verdict).tolist() == [2]


def test_choosing_the_rows_that_draft_reads_the_pool_once_a_step_not_once_per_row(tiny_target, engine, monkeypatch):
    """Under KV pressure the rows whose trees fit are found in one pass over the batch: dropping
    the last row and checking the whole pool again cost O(B^2) a step (37k checks over a
    generation of 256 requests, 13 ms of host time a step). Outputs stay plain decoding's."""
    from specflow.runtime.kv_cache import PagedKVCache
    from specflow.spec_step import SpeculativeDecoding

    n = 24
    prompts = [[(7 * i + j) % 300 + 1 for j in range(4)] for i in range(n)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    e = SpecEngine(tiny_target, {"type": "ngram", "max_window": 1}, {"type": "chain", "depth": 4}, {"type": "greedy"},
                   device="cpu", dtype="float32", kv_cache_tokens=n * 12, max_batch_size=n)
    counted, per_draft = [0], []
    pages_needed, draft = PagedKVCache.pages_needed, SpeculativeDecoding._draft

    def count(self, num_tokens):
        counted[0] += 1
        return pages_needed(self, num_tokens)

    def drafting(self, batch, roots):
        counted[0] = 0
        out = draft(self, batch, roots)
        per_draft.append((counted[0], len(batch), len(out[1])))
        return out

    monkeypatch.setattr(PagedKVCache, "pages_needed", count)
    monkeypatch.setattr(SpeculativeDecoding, "_draft", drafting)
    outs = e.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in engine.generate(prompts, params)]
    assert any(0 < drafted < rows for _, rows, drafted in per_draft)  # some rows' trees did not fit
    assert all(checks <= 3 * rows for checks, rows, _ in per_draft)
    assert e.runner.cache.num_pages_used == 0
