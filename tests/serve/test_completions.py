"""Generation through the real `openai` client against the speculative server: the same text as
plain decoding in-process, streaming equal to non-streaming, chat templates (tool-use
conversations too), n / seed, logprobs under speculation, and 32 concurrent requests under KV
pressure equal to sequential ones."""

import dataclasses
import uuid
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch

from specflow import SamplingParams, SpecEngine
from specflow.request import RequestOutput
from tests.serve.conftest import KV_CACHE_TOKENS, MODEL, NUM_DRAFT_TOKENS

pytestmark = pytest.mark.xdist_group("serve")

PROMPTS = ["def main():\n    ", "import os\nimport sys\n", "class Stack:\n    def push(self, item):"]
GREEDY = {"temperature": 0.0, "max_tokens": 16, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def reference(chat_target):
    """Plain decoding of the same checkpoint, in this process."""
    return SpecEngine(chat_target, device="cpu", dtype="float32")


def stream_text(chunks, n: int = 1, chat: bool = False) -> tuple[list[str], list[str | None], object]:
    """Concatenated text and finish reason of each choice of an SSE stream, and its usage chunk."""
    texts, finish, usage = [""] * n, [None] * n, None
    for chunk in chunks:
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] += (c.delta.content or "") if chat else c.text
            finish[c.index] = c.finish_reason or finish[c.index]
    return texts, finish, usage


def stop_string(text: str) -> str:
    """Two characters from ``text`` after its start, neither an undecodable byte, so that the
    stop string occurs mid-generation."""
    for i in range(2, len(text) - 2):
        if "\ufffd" not in text[i:i + 2] and text[i:i + 2].strip():
            return text[i:i + 2]
    raise AssertionError(f"no stop string candidate in {text!r}")


def test_completion_equals_plain_decoding(client, reference):
    """Speculation is lossless at temperature 0: the server's text is plain decoding's text."""
    expected = reference.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    for prompt, ref in zip(PROMPTS, expected):
        out = client.completions.create(model=MODEL, prompt=prompt, **GREEDY)
        assert out.choices[0].text == ref.text and out.choices[0].finish_reason == "length"
        assert out.usage.completion_tokens == 16 and out.usage.prompt_tokens == len(ref.prompt_token_ids)
        stats = out.usage.model_extra["accept_length"]   # the extension: per-step accept lengths
        assert stats["mean"] > 1 and sum(int(k) * v for k, v in stats["histogram"].items()) == 15


def test_a_shared_prefix_is_reported_cached_and_changes_nothing(client, server, reference):
    """The server caches prefixes (OpenAI's usage.prompt_tokens_details.cached_tokens): a
    conversation's second turn reuses the first with its answer, and its text is still plain
    decoding's; pages held only by the cache are not "used"."""
    system = {"role": "system", "content": "You complete Python code. " * 4}
    first = client.chat.completions.create(model=MODEL, messages=[system, {"role": "user", "content": "def f("}],
                                           **GREEDY)
    cached_before = server.metric("specflow_cached_prompt_tokens_total")
    messages = [system, {"role": "user", "content": "def f("},
                {"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "more"}]
    second = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens < cached < second.usage.prompt_tokens   # the first turn and some of its answer
    assert server.metric("specflow_cached_prompt_tokens_total") == cached_before + cached
    assert second.choices[0].message.content == plain_chat(reference, messages).text
    assert server.metric("specflow_kv_pages_used") == 0 < server.metric("specflow_kv_pages_cached")


def test_the_choices_of_a_new_prompt_report_none_of_it_cached(client):
    """With n > 1 the later choices read the pages the first one wrote; the prompt counts once,
    and one never sent before had none of its tokens cached."""
    prompt = f"# {uuid.uuid4().hex}\nclass Matrix:\n    def __init__(self, rows, cols):\n        self.rows = rows\n" * 2
    first, again = (client.completions.create(model=MODEL, prompt=prompt, n=3, max_tokens=2, temperature=1.0, seed=0)
                    for _ in range(2))
    assert first.usage.prompt_tokens_details.cached_tokens == 0 < again.usage.prompt_tokens_details.cached_tokens


def test_penalties_and_logit_bias_equal_plain_decoding_with_them(client, reference):
    """OpenAI's penalties and logit_bias, vLLM's repetition_penalty and min_tokens: under
    speculation, streamed or not, the server's text is plain decoding's with the same adjustments."""
    banned = reference.encode(PROMPTS[0])[-1]
    adjust = dict(frequency_penalty=1.5, presence_penalty=0.5, logit_bias={banned: -100.0, 7: 3.0},
                  repetition_penalty=1.8, min_tokens=10)
    params = SamplingParams(temperature=0.0, max_tokens=16, **adjust)
    expected = reference.generate(PROMPTS, params)
    assert [e.text for e in expected] != [e.text for e in reference.generate(PROMPTS, dataclasses.replace(
        params, logit_bias=None, frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0))]
    body = dict(temperature=0.0, max_tokens=16, frequency_penalty=1.5, presence_penalty=0.5,
                logit_bias={str(banned): -100, "7": 3}, extra_body={"repetition_penalty": 1.8, "min_tokens": 10})
    for prompt, ref in zip(PROMPTS, expected):
        out = client.completions.create(model=MODEL, prompt=prompt, **body)
        assert out.choices[0].text == ref.text and out.usage.completion_tokens == len(ref.token_ids)
        texts, _, _ = stream_text(client.completions.create(model=MODEL, prompt=prompt, stream=True, **body))
        assert texts == [ref.text]


def test_stop_token_ids_end_a_choice(client, reference):
    free = reference.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0]
    stop = free.token_ids[5]
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], temperature=0.0, max_tokens=16, logprobs=0,
                                    extra_body={"stop_token_ids": [stop], "top_k": 0})
    assert out.choices[0].finish_reason == "stop"
    assert len(out.choices[0].logprobs.tokens) == free.token_ids.index(stop) + 1
    assert out.choices[0].text == reference.decode(free.token_ids[:free.token_ids.index(stop)])   # (vLLM's text)


def test_prompt_as_token_ids_and_batch_of_prompts(client, reference):
    ids = [reference.encode(p) for p in PROMPTS]
    out = client.completions.create(model=MODEL, prompt=ids, **GREEDY)
    single = [client.completions.create(model=MODEL, prompt=p, **GREEDY).choices[0].text for p in PROMPTS]
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == single


@pytest.mark.parametrize("stop", [None, "stop-string"])
def test_completion_stream_equals_non_streaming(client, stop):
    for prompt in PROMPTS:
        kwargs = dict(GREEDY, max_tokens=24, n=2)
        if stop:
            free = client.completions.create(model=MODEL, prompt=prompt, **kwargs).choices[0].text
            kwargs["stop"] = [stop_string(free)]
        full = client.completions.create(model=MODEL, prompt=prompt, **kwargs)
        chunks = client.completions.create(model=MODEL, prompt=prompt, stream=True,
                                           stream_options={"include_usage": True}, **kwargs)
        texts, finish, usage = stream_text(chunks, n=2)
        assert texts == [c.text for c in full.choices] and finish == [c.finish_reason for c in full.choices]
        assert usage.completion_tokens == full.usage.completion_tokens
        assert usage.model_extra["accept_length"] == full.usage.model_extra["accept_length"]
        if stop:
            assert full.choices[0].finish_reason == "stop" and kwargs["stop"][0] not in full.choices[0].text


def plain_chat(reference: SpecEngine, messages: list[dict]) -> RequestOutput:
    """Plain greedy decoding of ``messages`` rendered by the same chat template, in this process."""
    prompt = reference.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return reference.generate([reference.tokenizer.encode(prompt, add_special_tokens=False)],
                              SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0]


def test_chat_renders_the_template(client, reference):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def add(a, b):"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    ref = plain_chat(reference, messages)
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == ref.text
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)


ADD_CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}


def test_chat_renders_tool_calls_and_results(client, reference):
    """A tool-use conversation reaches the template as transformers renders it: the assistant's
    ``tool_calls`` with their arguments as a mapping, the tool's ``tool_call_id`` and ``name``."""
    messages = [{"role": "user", "content": "1 + 2?"},
                {"role": "assistant", "content": None, "tool_calls": [ADD_CALL]},
                {"role": "tool", "tool_call_id": "call_1", "name": "add", "content": [{"type": "text", "text": "3"}]}]
    out = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    ref = plain_chat(reference, [
        messages[0],
        {"role": "assistant", "content": "", "tool_calls": [
            {**ADD_CALL, "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "add", "content": "3"}])
    assert out.choices[0].message.content == ref.text and out.usage.prompt_tokens == len(ref.prompt_token_ids)

    two_calls = [messages[0], {"role": "assistant", "tool_calls": [ADD_CALL, {**ADD_CALL, "id": "call_2"}]}]
    with pytest.raises(openai.BadRequestError, match="cannot render these messages.*one tool call per turn"):
        client.chat.completions.create(model=MODEL, messages=two_calls, **GREEDY)


def test_chat_stream_equals_non_streaming(client):
    messages = [{"role": "user", "content": [{"type": "text", "text": "import os"}]}]
    kwargs = dict(GREEDY, max_tokens=24, n=2)
    full = client.chat.completions.create(model=MODEL, messages=messages, **kwargs)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, **kwargs))
    assert {c.choices[0].index for c in chunks[:2]} == {0, 1} and chunks[0].choices[0].delta.role == "assistant"
    texts, finish, usage = stream_text(chunks, n=2, chat=True)
    assert texts == [c.message.content for c in full.choices]
    assert finish == [c.finish_reason for c in full.choices] == ["length", "length"]
    assert usage.total_tokens == full.usage.total_tokens


def test_n_choices_use_consecutive_seeds(client):
    kwargs = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 1.0, "seed": 11}
    many = client.completions.create(n=3, **kwargs)
    again = client.completions.create(n=3, **kwargs)
    assert [c.text for c in many.choices] == [c.text for c in again.choices]
    assert len({c.text for c in many.choices}) > 1
    second = client.completions.create(**{**kwargs, "seed": 12})
    assert second.choices[0].text == many.choices[1].text


def test_any_int64_seed_wraps_into_the_generator_range(client):
    """OpenAI takes negative seeds too: choice i samples with (seed + i) mod 2^63."""
    kwargs = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 1.0}
    many = client.completions.create(n=2, seed=-1, **kwargs)
    again = client.completions.create(n=2, seed=-1, **kwargs)
    assert [c.text for c in many.choices] == [c.text for c in again.choices]
    assert many.choices[0].text != many.choices[1].text
    assert client.completions.create(seed=2**63 - 1, **kwargs).choices[0].text == many.choices[0].text
    assert client.completions.create(seed=0, **kwargs).choices[0].text == many.choices[1].text


def test_echo_scores_the_prompt_as_lm_eval_asks(client, reference):
    """``echo`` with ``logprobs`` returns the prompt's tokens and logprobs (the first None) before
    the completion's, as lm-evaluation-harness's loglikelihood requests read them; ``max_tokens=0``
    returns the prompt alone. Streamed, the prompt comes in the first chunk."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    ref = reference.generate([PROMPTS[2]], params)[0]
    n_prompt = len(ref.prompt_token_ids)
    scored = client.completions.create(model=MODEL, prompt=PROMPTS[2], echo=True, max_tokens=0, logprobs=2,
                                       temperature=0.0)
    choice = scored.choices[0]
    assert choice.text == PROMPTS[2] and choice.finish_reason == "length" and scored.usage.completion_tokens == 0
    assert len(choice.logprobs.tokens) == n_prompt and choice.logprobs.token_logprobs[0] is None
    torch.testing.assert_close(torch.tensor(choice.logprobs.token_logprobs[1:]),
                               torch.tensor([lp.logprob for lp in ref.prompt_logprobs[1:]]))
    assert choice.logprobs.top_logprobs[0] is None and all(len(t) in (2, 3) for t in choice.logprobs.top_logprobs[1:])
    body = dict(model=MODEL, prompt=PROMPTS[2], echo=True, logprobs=2, temperature=0.0, max_tokens=4,
                extra_body={"ignore_eos": True})
    full = client.completions.create(**body).choices[0]
    assert full.text == PROMPTS[2] + ref.text and len(full.logprobs.tokens) == n_prompt + 4
    assert full.logprobs.text_offset[n_prompt] == len(PROMPTS[2])
    torch.testing.assert_close(torch.tensor(full.logprobs.token_logprobs[n_prompt:]),
                               torch.tensor([lp.logprob for lp in ref.logprobs]), **FLOAT32_SUMS)
    chunks = list(client.completions.create(stream=True, **body))
    assert chunks[0].choices[0].text.startswith(PROMPTS[2])
    assert "".join(c.choices[0].text for c in chunks) == full.text
    assert sum((c.choices[0].logprobs.token_logprobs for c in chunks), []) == full.logprobs.token_logprobs
    # n choices of a prompt: its first scores it for all (the others prefill from the prefix cache)
    several = client.completions.create(**{**body, "n": 3, "temperature": 0.8, "seed": 1}).choices
    assert [c.logprobs.token_logprobs[:n_prompt] for c in several] == [full.logprobs.token_logprobs[:n_prompt]] * 3
    assert [c.logprobs.top_logprobs[:n_prompt] for c in several] == [full.logprobs.top_logprobs[:n_prompt]] * 3
    without = client.completions.create(model=MODEL, prompt=[5, 6, 7], echo=True, max_tokens=2, temperature=0.0)
    assert without.choices[0].text.startswith(reference.decode([5, 6, 7])) and without.choices[0].logprobs is None


def test_echo_offsets_count_a_special_token_written_in_the_prompt(client):
    """A text prompt that writes a special token (``<|endoftext|>``) is echoed as sent, so that
    token takes its own characters in ``text_offset``: every prompt token starts where its text is."""
    prompt = PROMPTS[0] + "<|endoftext|>" + PROMPTS[1]
    body = dict(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=3, temperature=0.0,
                extra_body={"ignore_eos": True})
    whole = client.completions.create(**body)
    choice, n_prompt = whole.choices[0], whole.usage.prompt_tokens
    lp = choice.logprobs
    assert choice.text.startswith(prompt) and "<|endoftext|>" in lp.tokens[:n_prompt]
    assert [choice.text[o:o + len(t)] for t, o in zip(lp.tokens, lp.text_offset)][:n_prompt] == lp.tokens[:n_prompt]
    assert lp.text_offset[n_prompt] == len(prompt)
    streamed = list(client.completions.create(stream=True, **body))
    assert sum((c.choices[0].logprobs.text_offset for c in streamed), []) == lp.text_offset


# a tree's forward and a decode step sum in other orders: float32 logprobs differ by ~1e-5 (torch 2.5)
FLOAT32_SUMS = dict(atol=1e-4, rtol=1e-5)


def test_logprobs_under_speculation_equal_plain_decoding(client):
    """Committed tokens' log-probabilities come from the target at the node that committed them,
    so a speculative request reports what a plain one does."""
    kwargs = dict(model=MODEL, prompt=PROMPTS[1], logprobs=3, **GREEDY)
    spec = client.completions.create(**kwargs)
    plain = client.completions.create(**{**kwargs, "extra_body": {"ignore_eos": True, "speculative": False}})
    assert spec.usage.model_extra["accept_length"]["mean"] > 1
    assert plain.usage.model_extra["accept_length"]["mean"] == 1
    a, b = spec.choices[0].logprobs, plain.choices[0].logprobs
    assert a.tokens == b.tokens and len(a.tokens) == 16
    torch.testing.assert_close(torch.tensor(a.token_logprobs), torch.tensor(b.token_logprobs), **FLOAT32_SUMS)
    for top_a, top_b, tok, lp in zip(a.top_logprobs, b.top_logprobs, a.tokens, a.token_logprobs):
        assert top_a.keys() == top_b.keys() and top_a[tok] == lp and lp == max(top_a.values())  # greedy

    messages = [{"role": "user", "content": "x = 1"}]
    chat = dict(model=MODEL, messages=messages, logprobs=True, top_logprobs=2, **GREEDY)
    spec = client.chat.completions.create(**chat).choices[0].logprobs.content
    plain = client.chat.completions.create(
        **{**chat, "extra_body": {"ignore_eos": True, "speculative": False}}).choices[0].logprobs.content
    assert [t.token for t in spec] == [t.token for t in plain] and len(spec) == 16
    torch.testing.assert_close(torch.tensor([[t.logprob] + [x.logprob for x in t.top_logprobs] for t in spec]),
                               torch.tensor([[t.logprob] + [x.logprob for x in t.top_logprobs] for t in plain]),
                               **FLOAT32_SUMS)


def test_32_concurrent_requests_under_kv_pressure_equal_sequential(client, server, reference):
    """Requests that do not fit wait for pages instead of failing; batching changes no output. Above
    spec_max_batch_size (8) steps do not speculate, so the concurrent run takes more steps."""
    prompts = [f"def f{i}(x):\n    return x * {i}" for i in range(32)]
    lengths = [len(reference.encode(p)) for p in prompts]
    assert sum(n + 24 + NUM_DRAFT_TOKENS for n in lengths) > 2 * KV_CACHE_TOKENS  # most must queue

    def complete(prompt: str) -> tuple[str, int]:
        out = client.completions.create(model=MODEL, prompt=prompt, **dict(GREEDY, max_tokens=24))
        return out.choices[0].text, out.usage.model_extra["accept_length"]["steps"]

    sequential = [complete(p) for p in prompts]
    with ThreadPoolExecutor(32) as pool:
        concurrent = list(pool.map(complete, prompts))
    assert [text for text, _ in concurrent] == [text for text, _ in sequential]
    assert sum(steps for _, steps in concurrent) > sum(steps for _, steps in sequential)
    assert server.metric("specflow_kv_pages_used") == 0 and server.metric("specflow_queue_length") == 0
