"""The suite's correctness claims on a CUDA GPU, with both attention backends (``make test-gpu``):
logits equal to transformers, and every learned drafter x tree greedy-lossless, on the shipped
family. The torch backend runs in float32 with CUDA graphs (the default on CUDA) and must match
token for token; flashinfer has no float32 kernels, so it runs in bfloat16, where a sequence may
part from plain decoding only at a near-tie of the target's logits (``assert_lossless``)."""

import pytest
import torch

from specflow import SamplingParams, SpecEngine
from specflow.models import load_model
from specflow.penalties import History, Penalties
from specflow.runtime.flashinfer_backend import flashinfer_available
from specflow.runtime.model_runner import ModelRunner

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ZOO = "zoo/tiny-code"
BACKENDS = [  # (backend, dtype)
    pytest.param(("torch", torch.float32), id="torch-fp32"),
    pytest.param(("flashinfer", torch.bfloat16), id="flashinfer-bf16",
                 marks=pytest.mark.skipif(not flashinfer_available(), reason="flashinfer is not installed")),
]
DRAFTERS = {
    "ngram": {"type": "ngram"},
    "draft": {"type": "draft_model", "path": f"{ZOO}/draft"},
    "eagle": {"type": "eagle", "path": f"{ZOO}/eagle"},
    "eagle3": {"type": "eagle3", "path": f"{ZOO}/eagle3"},
}
TREES = {
    "chain": {"type": "chain", "depth": 4},
    "eagle2": {"type": "eagle2", "topk": 4, "depth": 4, "num_draft_tokens": 16},
}
PROMPTS = ["def main(", "import os\nimport sys\n", "class Tree:\n    def __init__(self", "for i in range("]
GREEDY = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (48, 32, 40, 24)]


@pytest.mark.parametrize("setting", BACKENDS)
def test_logits_match_transformers(setting):
    from transformers import AutoModelForCausalLM

    backend, dtype = setting
    hf = AutoModelForCausalLM.from_pretrained(f"{ZOO}/target", dtype=dtype).to("cuda").eval()
    runner = ModelRunner(load_model(f"{ZOO}/target", device="cuda", dtype=dtype), num_pages=1024, backend=backend)
    assert type(runner.attn).__name__.lower().startswith(backend)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 2048, (n,), generator=g) for n in (5, 33, 70)]
    ours = runner.extend([0, 1, 2], prompts).logits                                    # [T, V]
    with torch.inference_mode():
        theirs = torch.cat([hf(p[None].cuda()).logits[0] for p in prompts])           # [T, V]
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.05)
    torch.testing.assert_close(ours.float(), theirs.float(), **tol)


TIE = 0.25  # bfloat16 logit gap within which kernels summing in another order may pick either token


def assert_lossless(outs, baseline, model, backend: str, params: SamplingParams | None = None) -> None:
    """Token for token equal to plain decoding. In bfloat16 the tree kernels and the decode kernel
    round differently, so a sequence may part from the baseline at a near-tie: there the two
    tokens' logits (one plain forward over the shared prefix, adjusted by ``params``' penalties)
    must lie within ``TIE``, and the rest of the sequence, which continues from another token, is
    not compared."""
    for ours, theirs in zip(outs, baseline):
        if ours.token_ids == theirs.token_ids:
            continue
        assert model.lm_head.weight.dtype == torch.bfloat16, f"{ours.token_ids} != {theirs.token_ids}"
        i = next(i for i, (a, b) in enumerate(zip(ours.token_ids, theirs.token_ids)) if a != b)
        runner = ModelRunner(model, num_pages=1024, backend=backend)
        logits = runner.extend([0], [theirs.prompt_token_ids + theirs.token_ids[:i]], logits="last").logits
        if params is not None and params.adjusts_logits:
            history = History(params, theirs.prompt_token_ids, theirs.token_ids[:i], set(params.stop_token_ids))
            logits = Penalties.build([history], logits.shape[-1], logits.device).apply(logits[:, None])[:, 0]
        logits = logits[0]
        gap = float(logits[theirs.token_ids[i]] - logits[ours.token_ids[i]])
        assert abs(gap) <= TIE, f"token {i}: {ours.token_ids[i]} instead of {theirs.token_ids[i]}, logit gap {gap}"


@pytest.fixture(scope="module", params=BACKENDS)
def plain(request):
    """(backend, the loaded target engine, its plain greedy outputs)."""
    backend, dtype = request.param
    engine = SpecEngine(f"{ZOO}/target", device="cuda", dtype=dtype, backend=backend)
    return backend, engine, engine.generate(PROMPTS, GREEDY)


@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("drafter", DRAFTERS)
def test_greedy_is_lossless(plain, drafter, tree):
    backend, target, baseline = plain
    engine = SpecEngine(target.model, DRAFTERS[drafter], TREES[tree], {"type": "greedy"},
                        tokenizer=target.tokenizer, backend=backend)
    outs = engine.generate(PROMPTS, GREEDY)
    assert_lossless(outs, baseline, target.model, backend)
    if drafter != "ngram":
        assert max(max(o.accept_lengths) for o in outs) > 1, "the shipped drafter never got a draft accepted"


@pytest.mark.parametrize("setting", BACKENDS)
def test_medusa_static_tree_is_lossless(setting):
    backend, dtype = setting
    params = GREEDY[:2]
    plain = SpecEngine(f"{ZOO}/target", device="cuda", dtype=dtype, backend=backend).generate(PROMPTS[:2], params)
    engine = SpecEngine(f"{ZOO}/target", {"type": "medusa", "path": f"{ZOO}/medusa"},
                        {"type": "static", "preset": "medusa_63"}, {"type": "greedy"},
                        device="cuda", dtype=dtype, backend=backend)
    assert_lossless(engine.generate(PROMPTS[:2], params), plain, engine.model, backend)


@pytest.mark.parametrize("drafter", ["eagle", "eagle3", "draft"])
def test_prefix_caching_is_lossless_on_the_gpu(plain, drafter):
    """Requests that share a prefix read its cached pages (and the drafter its cached target
    features) through the backend's paged attention and the CUDA graphs."""
    backend, target, _ = plain
    system = "import os\nimport sys\n" * 6
    prompts = [system + p for p in PROMPTS]
    baseline = SpecEngine(target.model, tokenizer=target.tokenizer, backend=backend).generate(prompts, GREEDY)
    engine = SpecEngine(target.model, DRAFTERS[drafter], TREES["eagle2"], {"type": "greedy"},
                        tokenizer=target.tokenizer, backend=backend, prefix_caching=True)
    outs = [engine.generate([p], params)[0] for p, params in zip(prompts, GREEDY)]  # later ones hit the cache
    assert engine.runner.cache.prefix.num_cached > 0
    assert_lossless(outs, baseline, target.model, backend)


PENALIZED = dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.5, logit_bias={13: 2.0},
                 min_tokens=8)


@pytest.mark.parametrize("drafter, tree", [("eagle", "eagle2"), ("ngram", "chain")])
def test_penalties_are_lossless_on_the_gpu(plain, drafter, tree):
    """Every node adjusted by its own path on the device, plain decoding's in-flight tokens counted
    there: greedy output with penalties is plain decoding's with them."""
    backend, target, _ = plain
    params = [SamplingParams(temperature=0.0, max_tokens=p.max_tokens, ignore_eos=True, **PENALIZED) for p in GREEDY]
    baseline = SpecEngine(target.model, tokenizer=target.tokenizer, backend=backend).generate(PROMPTS, params)
    engine = SpecEngine(target.model, DRAFTERS[drafter], TREES[tree], {"type": "greedy"},
                        tokenizer=target.tokenizer, backend=backend)
    for ours, theirs, p in zip(engine.generate(PROMPTS, params), baseline, params):
        assert_lossless([ours], [theirs], target.model, backend, p)


@pytest.mark.parametrize("verifier", ["rejection", "typical", "threshold"])
@pytest.mark.parametrize("drafter, tree", [("eagle", "eagle2"), ("ngram", "chain")])
def test_sampled_verifiers_run_on_the_gpu(plain, drafter, tree, verifier):
    """The sampled verifiers' walks over trees built on the device (a beam's) and on the host
    (moved by the engine) next to the target's logits. With top_k 1 every sampled request is
    greedy in disguise, so a lossless verifier's output is plain greedy decoding's (typical
    acceptance judges drafts by the untruncated distribution, so only its length is known)."""
    backend, target, baseline = plain
    engine = SpecEngine(target.model, DRAFTERS[drafter], TREES[tree], {"type": verifier},
                        tokenizer=target.tokenizer, backend=backend)
    params = [SamplingParams(temperature=0.8, top_k=1, max_tokens=p.max_tokens, ignore_eos=True, seed=i)
              for i, p in enumerate(GREEDY)]
    outs = engine.generate(PROMPTS, params)
    if engine.verifier.lossless:
        assert_lossless(outs, baseline, target.model, backend)
    assert [len(o.token_ids) for o in outs] == [p.max_tokens for p in params]


@pytest.mark.parametrize("verifier, temperature", [("greedy", 0.0), ("rejection", 0.8), ("typical", 0.8),
                                                   ("threshold", 0.8)])
def test_an_eagle2_step_waits_for_the_gpu_once(plain, verifier, temperature):
    """With CUDA graphs, a beam's tree stays on the device through the target's forward and
    the verifier's walk (every verifier walks a top-k tree on the device, sampled or greedy):
    the host waits once per step, for the verdict."""
    from specflow.bench.gpu import sync_points

    backend, target, _ = plain
    engine = SpecEngine(target.model, DRAFTERS["eagle"], TREES["eagle2"], {"type": verifier},
                        tokenizer=target.tokenizer, backend=backend)
    waits = sync_points(engine, target.encode(PROMPTS[0]), torch.device("cuda"), max_tokens_per_step=5,
                        temperature=temperature)
    assert waits["per_step"] <= 1, waits["sites"]


@pytest.mark.parametrize("drafter", [None, "eagle3"], ids=["no-drafter", "eagle3-paused"])
@pytest.mark.parametrize("adjust", [{}, PENALIZED], ids=["plain", "penalized"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_plain_decoding_returns_before_the_gpu_is_done(plain, temperature, adjust, drafter):
    """Plain decoding runs one step ahead of the host: a step queues the next forward and its
    sampling (penalties counting the token in flight on the device), then lands the last step's
    tokens, with no wait for the work it queued; so does an engine whose drafter does not
    speculate (spec_max_batch_size 0), which also feeds its drafter the landed step. A GPU sleep
    queued first holds that work back, and the step must return before the sleep is over."""
    backend, target, _ = plain
    engine = SpecEngine(target.model, DRAFTERS.get(drafter), tokenizer=target.tokenizer, backend=backend,
                        spec_max_batch_size=0 if drafter else None)
    rid = engine.add_request(target.encode(PROMPTS[0]), SamplingParams(temperature=temperature, max_tokens=32,
                                                                       ignore_eos=True, seed=0, **adjust))
    for _ in range(4):  # prefill, then steps that capture the decode graph
        engine.step()
    torch.cuda.synchronize()
    torch.cuda._sleep(1 << 30)  # about half a second of GPU clock cycles ahead of the step's work
    slept = torch.cuda.Event()
    slept.record()
    engine.step()
    waited = slept.query()  # any wait for work queued after the landed step's would outlast the sleep
    torch.cuda.synchronize()
    engine.abort(rid)
    assert not waited, "the step waited for the GPU beyond the step it landed"
