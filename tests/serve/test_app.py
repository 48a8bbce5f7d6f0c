"""The HTTP surface of the speculative server: models / health / metrics, OpenAI-style 4xx errors
for every bad input while a good request is served alongside, request limits, tokenizing off the
event loop, the API key, and client disconnects returning their KV pages at once."""

import asyncio
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from specflow import SpecEngine
from specflow.serve import build_app
from specflow.serve.app import decode_body
from specflow.serve.inputs import ApiError
from specflow.serve.chat_protocol import ChatCompletionRequest
from specflow.serve.protocol import CompletionRequest
from tests.serve.conftest import API_KEY, KV_CACHE_TOKENS, MAX_SEQUENCES, MAX_REQUEST_BYTES, MODEL

pytestmark = pytest.mark.xdist_group("serve")

AUTH = {"Authorization": f"Bearer {API_KEY}"}
GOOD = {"model": MODEL, "prompt": "def main():", "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}

# (name, endpoint, body or raw bytes, status, param the error names or a fragment of its message)
BAD = [
    ("malformed json", "completions", b'{"model": "tiny-chat", "prompt": "x", "max_tok', 400, "not valid JSON"),
    ("body not an object", "completions", [1, 2], 400, "must be a JSON object"),
    ("empty body", "completions", b"", 400, "must be a JSON object"),
    ("body in no Unicode encoding", "completions", b'{"model": "\xff\xfe\xfd"}', 400, "not valid JSON"),
    ("nesting past the stack", "completions", b"[" * 100_000 + b"]" * 100_000, 400, "not valid JSON"),
    ("a number of 5000 digits", "completions", b'{"model": "tiny-chat", "seed": ' + b"9" * 5000 + b"}", 400,
     "not valid JSON: a number has more than 4300 digits"),
    ("wrong type temperature", "completions", {**GOOD, "temperature": "hot"}, 400, "temperature"),
    ("wrong type max_tokens", "completions", {**GOOD, "max_tokens": "ten"}, 400, "max_tokens"),
    ("wrong type stream", "completions", {**GOOD, "stream": "yes"}, 400, "stream"),
    ("wrong type prompt", "completions", {**GOOD, "prompt": 5}, 400, "prompt"),
    ("wrong type messages", "chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages"),
    ("unknown field", "completions", {**GOOD, "best_of_all": 2}, 400, "best_of_all: not a parameter this server takes"),
    ("missing prompt", "completions", {"model": MODEL}, 400, "prompt"),
    ("empty prompt", "completions", {**GOOD, "prompt": []}, 400, "prompt"),
    ("empty messages", "chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("unknown role", "chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]},
     400, "messages.0.role"),
    ("tool message without tool_call_id", "chat/completions",
     {"model": MODEL, "messages": [{"role": "tool", "content": "3"}]}, 400, "messages.0"),
    ("tool_calls on a user message", "chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": "x", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]}]},
     400, "messages.0"),
    ("temperature > 2", "completions", {**GOOD, "temperature": 3}, 400, "temperature"),
    ("NaN temperature", "completions", json.dumps({**GOOD, "temperature": float("nan")}).encode(), 400,
     "temperature: Input should be a finite number"),
    ("infinite logit_bias", "completions", json.dumps({**GOOD, "logit_bias": {"5": float("-inf")}}).encode(), 400,
     "finite number"),
    ("top_p = 0", "completions", {**GOOD, "top_p": 0}, 400, "top_p"),
    ("top_k < -1", "completions", {**GOOD, "top_k": -2}, 400, "top_k"),
    ("stop_token_ids past the vocabulary", "completions", {**GOOD, "stop_token_ids": [5, 100000]}, 400,
     "stop_token_ids"),
    ("top_k beyond int64", "completions", {**GOOD, "top_k": 2**64}, 400, "top_k"),
    ("min_p > 1", "completions", {**GOOD, "min_p": 2}, 400, "min_p"),
    ("n = 0", "completions", {**GOOD, "n": 0}, 400, "n"),
    ("max_tokens = 0", "completions", {**GOOD, "max_tokens": 0}, 400, "max_tokens"),
    ("logprobs > 20", "completions", {**GOOD, "logprobs": 50}, 400, "logprobs"),
    ("seed beyond int64", "completions", {**GOOD, "seed": 2**63}, 400, "seed"),
    ("seed below int64", "completions", {**GOOD, "seed": -2**63 - 1}, 400, "seed"),
    ("empty stop string", "completions", {**GOOD, "stop": [""]}, 400, "stop"),
    ("presence_penalty > 2", "completions", {**GOOD, "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("frequency_penalty < -2", "completions", {**GOOD, "frequency_penalty": -3}, 400, "frequency_penalty"),
    ("repetition_penalty = 0", "completions", {**GOOD, "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("repetition_penalty past float32", "completions", {**GOOD, "repetition_penalty": 1e39}, 400,
     "repetition_penalty"),
    ("min_tokens > max_tokens", "completions", {**GOOD, "min_tokens": 9}, 400, "min_tokens"),
    ("logit_bias key no token id", "chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                        "logit_bias": {"a5": 10}}, 400, "logit_bias"),
    ("logit_bias value > 100", "completions", {**GOOD, "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("logit_bias token past the vocabulary", "completions", {**GOOD, "logit_bias": {"100000": 1}}, 400, "logit_bias"),
    ("logit_bias token id past int's digits", "completions", {**GOOD, "logit_bias": {"9" * 5000: 1}}, 400,
     "logit_bias"),
    ("best_of > 1", "completions", {**GOOD, "best_of": 2}, 400, "best_of"),
    ("response_format json_object", "chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                         "response_format": {"type": "json_object"}},
     400, "response_format 'json_object' needs guided decoding"),
    ("response_format json_schema", "chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                         "response_format": {"type": "json_schema", "json_schema": {
                                                             "name": "answer", "schema": {"type": "object"}}}},
     400, "response_format 'json_schema' needs guided decoding"),
    ("stream_options without stream", "completions", {**GOOD, "stream_options": {"include_usage": True}},
     400, "stream_options"),
    ("top_logprobs without logprobs", "chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ("user message without content", "chat/completions", {"model": MODEL, "messages": [{"role": "user"}]},
     400, "a user message needs content"),
    ("assistant message without content or tool_calls", "chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}]},
     400, "an assistant message needs content (or tool_calls)"),
    ("unknown model", "completions", {**GOOD, "model": "gpt-5"}, 404, "model"),
    ("prompt longer than the context", "completions", {**GOOD, "prompt": [7] * 5000}, 400, "context length"),
    ("max_tokens beyond the context", "completions", {**GOOD, "max_tokens": 5000}, 400, "context length"),
    ("prompt larger than the KV cache", "completions", {**GOOD, "prompt": [7] * 600}, 400, "KV cache"),
    # refused by its length alone, before tokenizing (which costs seconds a megabyte)
    ("prompt text past any context", "completions", {**GOOD, "prompt": "x" * (MAX_REQUEST_BYTES // 2)},
     400, "far more than the context (512 tokens"),
    ("token id outside the vocabulary", "completions", {**GOOD, "prompt": [1, 2, 100000]}, 400, "vocabulary"),
    ("more prompts than limits.max_sequences", "completions", {**GOOD, "prompt": ["x"] * (MAX_SEQUENCES + 1)},
     400, "prompt"),
    ("prompts x n over limits.max_sequences", "completions", {**GOOD, "prompt": ["x"] * 3, "n": 3},
     400, "3 prompt(s) x n=3 = 9 sequences"),
    ("chat n over limits.max_sequences", "chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": MAX_SEQUENCES + 1},
     400, f"1 prompt(s) x n={MAX_SEQUENCES + 1} = {MAX_SEQUENCES + 1} sequences"),
    ("body over limits.max_request_bytes", "completions", {**GOOD, "prompt": "x" * MAX_REQUEST_BYTES},
     413, "limits.max_request_bytes"),
    # JSON's "\ud800" escapes are valid JSON but lone surrogates, no Unicode text: no tokenizer takes them
    ("lone surrogate in a prompt", "completions", json.dumps({**GOOD, "prompt": ["ok", "a\ud800b"]}).encode(),
     400, "prompt"),
    ("lone surrogate in a message", "chat/completions",
     json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "\udfff"}]}).encode(), 400, "messages"),
    ("lone surrogate in the model name", "completions", json.dumps({**GOOD, "model": "\ud800"}).encode(),
     404, "model"),
]


def post(url: str, endpoint: str, body, content_type: str = "application/json") -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{url}/v1/{endpoint}", content=content, timeout=120,
                      headers={**AUTH, "Content-Type": content_type})


def test_models_health_metrics(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    # the KV cache (KV_CACHE_TOKENS) holds fewer tokens than the model's context: it is the limit
    assert httpx.get(server.url + "/v1/models", headers=AUTH).json()["data"][0]["max_model_len"] == KV_CACHE_TOKENS
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("org/other-model")
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    text = httpx.get(server.url + "/metrics").text
    for name in ("specflow_requests_total", "specflow_prompt_tokens_total", "specflow_generation_tokens_total",
                 "specflow_accept_length_bucket", "specflow_step_seconds_bucket", "specflow_queue_length",
                 "specflow_running_requests", "specflow_kv_pages_used", "specflow_kv_pages_total"):
        assert name in text


def test_bad_inputs_are_openai_errors_while_a_good_request_is_served(server):
    good_stream = {**GOOD, "max_tokens": 32, "stream": True}
    expected = post(server.url, "completions", {**GOOD, "max_tokens": 32}).json()["choices"][0]["text"]
    with ThreadPoolExecutor(8) as pool:
        good = pool.submit(post, server.url, "completions", good_stream)
        bad = list(pool.map(lambda case: post(server.url, case[1], case[2]), BAD))
    for (name, _, _, status, where), response in zip(BAD, bad):
        assert response.status_code == status, name
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, name
        assert error["type"] == "invalid_request_error", name
        assert where in error["message"] or where == error["param"], (name, error)
        assert "Value error" not in error["message"], (name, error)   # (pydantic's wording of our checks)
    events = [line[6:] for line in good.result().text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == expected


@pytest.mark.parametrize("model, body, param", [
    (CompletionRequest, {**GOOD, "stream_options": {"include_usage": True}}, "stream_options"),
    (ChatCompletionRequest, {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     "top_logprobs"),
    (ChatCompletionRequest, {"model": MODEL, "messages": [{"role": "system", "content": "x"}, {"role": "user"}]},
     "messages.1"),
])
def test_a_check_across_fields_names_the_field_it_refuses(model, body, param):
    with pytest.raises(ApiError) as refused:
        decode_body(model, json.dumps(body).encode(), "application/json")
    assert refused.value.body["error"]["param"] == param


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "application/jsonl"])
def test_a_body_must_be_sent_as_json(server, content_type):
    response = post(server.url, "completions", GOOD, content_type)
    assert response.status_code == 400 and "must be a JSON object" in response.json()["error"]["message"]
    assert post(server.url, "completions", GOOD, "application/json; charset=utf-8").status_code == 200
    assert post(server.url, "completions", GOOD, "application/vnd.api+json").status_code == 200


def test_a_body_without_content_type_is_read_as_json(server):
    """As FastAPI (vLLM, SGLang) reads it: `requests.post(url, data=json.dumps(body))` sends no
    Content-Type."""
    response = httpx.post(server.url + "/v1/completions", content=json.dumps(GOOD).encode(), headers=AUTH)
    assert "content-type" not in response.request.headers
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == GOOD["max_tokens"]


def test_chunked_body_over_the_limit_is_413(server):
    """A body without Content-Length is cut off once the bytes read pass the limit."""
    chunks = (b"x" * 2**16 for _ in range(MAX_REQUEST_BYTES // 2**16 + 1))
    response = httpx.post(server.url + "/v1/completions", content=chunks, timeout=120,
                          headers={**AUTH, "Content-Type": "application/json"})
    assert "content-length" not in response.request.headers
    assert response.status_code == 413 and "limits.max_request_bytes" in response.json()["error"]["message"]


def test_parsing_and_tokenizing_run_off_the_event_loop(chat_target, monkeypatch):
    """Decoding and validating a body, tokenizing a prompt and rendering a chat run on worker
    threads: on the event loop, a body of many MB would stall every stream for as long as they
    take. (In process, over the real app.)"""
    engine = SpecEngine(chat_target)
    calls = []  # (function, whether an event loop runs in the calling thread)

    def recorded(fn):
        def call(*args, **kwargs):
            try:
                asyncio.get_running_loop()
                calls.append((fn.__name__, True))
            except RuntimeError:  # no loop runs in this thread
                calls.append((fn.__name__, False))
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(engine, "encode", recorded(engine.encode))
    monkeypatch.setattr(engine.tokenizer, "apply_chat_template", recorded(engine.tokenizer.apply_chat_template))
    for request_type in (CompletionRequest, ChatCompletionRequest):
        monkeypatch.setattr(request_type, "model_validate", recorded(request_type.model_validate))
    with TestClient(build_app(engine, MODEL)) as client:
        for endpoint, body in (("completions", {"model": MODEL, "prompt": ["x", "y"], "max_tokens": 2}),
                               ("chat/completions", {"model": MODEL, "max_tokens": 2,
                                                     "messages": [{"role": "user", "content": "x"}]})):
            assert client.post(f"/v1/{endpoint}", json=body).status_code == 200
    assert {name for name, _ in calls} == {"model_validate", "encode", "apply_chat_template"}
    assert not any(on_loop for _, on_loop in calls), calls


def test_a_request_the_engine_fails_to_add_is_a_500_and_the_next_is_served(chat_target, monkeypatch):
    """An exception other than the engine's ValueError (a component's bug while adding) killed the
    engine thread and left the handler waiting for good."""
    engine = SpecEngine(chat_target)
    add_request, calls = engine.add_request, []

    def fails_once(*args, **kwargs):
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError("a drafter's bug")
        return add_request(*args, **kwargs)

    monkeypatch.setattr(engine, "add_request", fails_once)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    with TestClient(build_app(engine, MODEL)) as client:
        failed = client.post("/v1/completions", json=body)
        assert failed.status_code == 500 and failed.json()["error"]["type"] == "server_error"
        assert "failed to add the request" in failed.json()["error"]["message"]
        assert client.post("/v1/completions", json=body).status_code == 200


def test_sampling_params_are_checked_once_per_request(chat_target, monkeypatch):
    """A request's SamplingParams are built and checked once on the event loop, whatever its n and
    its number of prompts (each choice a copy with its own seed), and stop_token_ids arrive each
    id once: a 4 MB body of one id repeated 1.5M times with n=16 held the event loop (/health,
    every stream) for 9 s, checking 16 x 1.5M ids."""
    from specflow.sampling import SamplingParams

    engine = SpecEngine(chat_target)
    checked = []
    post_init = SamplingParams.__post_init__
    monkeypatch.setattr(SamplingParams, "__post_init__",
                        lambda self: (checked.append(list(self.stop_token_ids)), post_init(self))[1])
    body = {**GOOD, "prompt": ["x = 1", "y = 2"], "n": 3, "seed": 5, "temperature": 1.0,
            "stop_token_ids": [7] * 1000 + [9, 7]}
    with TestClient(build_app(engine, MODEL)) as client:
        response = client.post("/v1/completions", json=body)
        again = client.post("/v1/completions", json={**body, "stop_token_ids": [7, 9]})
    assert response.status_code == 200 and checked == [[7, 9], [7, 9]]
    texts = [c["text"] for c in response.json()["choices"]]
    assert texts == [c["text"] for c in again.json()["choices"]]
    assert texts[0] != texts[1] and texts[:3] != texts[3:]   # (seeds 5, 6, 7 for each prompt)


def test_an_echo_cancelled_in_the_queue_keeps_its_logprobs_arrays_aligned(chat_target):
    """A shutdown's cancel ends a queued echo choice before its prefill: its prompt tokens still
    come with one logprob entry each (null), not an empty token_logprobs beside them."""
    engine = SpecEngine(chat_target, max_batch_size=1)
    app = build_app(engine, MODEL)
    with TestClient(app) as client, ThreadPoolExecutor(2) as pool:
        running = pool.submit(client.post, "/v1/completions", json={**GOOD, "max_tokens": 4000})
        while not engine.scheduler.running:
            time.sleep(0.01)
        echo = pool.submit(client.post, "/v1/completions", json={**GOOD, "echo": True, "logprobs": 1})
        while not engine.scheduler.waiting:
            time.sleep(0.01)
        app.state.engine_loop.cancel_all()
        assert running.result().json()["choices"][0]["finish_reason"] == "abort"
        choice = echo.result().json()["choices"][0]
    n_prompt = len(engine.encode(GOOD["prompt"]))
    assert choice["finish_reason"] == "abort" and choice["text"] == GOOD["prompt"]
    assert {k: len(v) for k, v in choice["logprobs"].items()} == dict.fromkeys(
        ("tokens", "token_logprobs", "top_logprobs", "text_offset"), n_prompt)


def test_the_openapi_schema_documents_the_request_bodies(server):
    """The generation routes read their bodies themselves (off the event loop); /openapi.json
    still documents them, and every reference in it resolves."""
    schema = httpx.get(server.url + "/openapi.json").json()
    components = schema["components"]["schemas"]
    for path, model in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest")):
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"} and "model" in components[model]["properties"]
    refs = re.findall(r'"\$ref": "#/components/schemas/([^"]+)"', json.dumps(schema))
    assert refs and set(refs) <= set(components)


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-5", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=9)
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=9999)


@pytest.mark.parametrize("endpoint, body, param", [
    ("completions", {"prompt": [7] * (KV_CACHE_TOKENS + 1)}, "prompt"),
    ("completions", {"prompt": [7] * 10, "max_tokens": KV_CACHE_TOKENS}, "max_tokens"),
    ("chat", {"messages": [{"role": "user", "content": "x " * KV_CACHE_TOKENS}]}, "messages"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "max_tokens": KV_CACHE_TOKENS}, "max_tokens"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": KV_CACHE_TOKENS},
     "max_completion_tokens"),
])
def test_a_request_past_the_context_names_what_to_shorten(client, endpoint, body, param):
    """The context is the KV cache's here (KV_CACHE_TOKENS): the prompt is blamed when it leaves
    no room for a token, else the token limit that asks for too many."""
    create = client.completions.create if endpoint == "completions" else client.chat.completions.create
    with pytest.raises(openai.BadRequestError) as e:
        create(model=MODEL, **body)
    assert e.value.body["param"] == param and e.value.body["code"] == "context_length_exceeded"
    assert f"context length ({KV_CACHE_TOKENS} tokens, what the KV cache holds)" in e.value.body["message"]


def test_null_parameters_take_their_defaults(client):
    """The openai client sends a parameter set to None as null; OpenAI reads it as the default."""
    nulls = dict(temperature=None, top_p=None, n=None, seed=None, stop=None, presence_penalty=None,
                 frequency_penalty=None, stream_options=None)
    out = client.completions.create(model=MODEL, prompt="x", max_tokens=2, logprobs=None, best_of=None, **nulls)
    assert len(out.choices) == 1 and out.usage.completion_tokens == 2
    # and the no-op values clients send by default (LangChain: best_of 1, logit_bias {})
    out = client.completions.create(model=MODEL, prompt="x", max_tokens=2, best_of=1, logit_bias={})
    assert len(out.choices) == 1 and out.usage.completion_tokens == 2
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                          max_tokens=None, max_completion_tokens=2, logprobs=None,
                                          top_logprobs=None, response_format=None, **nulls)
    assert len(chat.choices) == 1 and chat.usage.completion_tokens == 2 and chat.choices[0].logprobs is None
    # OpenAI's default response format, plain text, is what the server generates
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                          max_completion_tokens=2, response_format={"type": "text"})
    assert chat.usage.completion_tokens == 2


def test_api_key(server):
    anonymous = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        anonymous.models.list()
    response = httpx.post(server.url + "/v1/completions", json=GOOD)
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    # the scheme in any case (RFC 9110), the key exactly
    for header, status in ((f"bearer {API_KEY}", 200), (f"BEARER {API_KEY}", 200), (f"Bearer {API_KEY.upper()}x", 401),
                           (f"Basic {API_KEY}", 401), (API_KEY, 401), (f"Bearer  {API_KEY}", 401)):
        assert httpx.get(server.url + "/v1/models", headers={"Authorization": header}).status_code == status, header
    assert httpx.get(server.url + "/health").status_code == 200   # probes and scrapers need no key
    assert httpx.get(server.url + "/metrics").status_code == 200


def wait_for_no_pages(server, polls: int = 600) -> None:
    for _ in range(polls):
        if server.metric("specflow_kv_pages_used") == 0:
            return
        time.sleep(0.05)
    raise AssertionError("the KV pages of the disconnected request were never freed")


def test_stream_disconnect_frees_pages_at_once(server):
    aborted = server.metric("specflow_requests_finished_total", finish_reason="abort")
    body = {**GOOD, "max_tokens": 480, "stream": True, "speculative": False}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=120) as response:
        lines = response.iter_lines()   # held, so that the stream stays open until the block ends
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
        assert server.metric("specflow_kv_pages_used") > 0
    wait_for_no_pages(server)
    assert server.metric("specflow_requests_finished_total", finish_reason="abort") == aborted + 1
    assert server.metric("specflow_running_requests") == 0


def test_non_streaming_disconnect_frees_pages(server):
    aborted = server.metric("specflow_requests_finished_total", finish_reason="abort")
    body = {**GOOD, "max_tokens": 480, "speculative": False}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up long before 480 tokens
        httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=httpx.Timeout(30, read=0.2))
    wait_for_no_pages(server)
    assert server.metric("specflow_requests_finished_total", finish_reason="abort") == aborted + 1


def test_a_client_gone_mid_body_is_499_not_a_server_error(server):
    """A client that closes its connection before sending the whole body (a timeout while a large
    prompt uploads) is a client closed request, as a disconnect after the body is: no 500 in
    specflow_requests_total, no traceback in the log."""
    import socket

    errors, closed = (server.metric("specflow_requests_total", endpoint="/v1/completions", status=s)
                      for s in ("500", "499"))
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
                  "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\":".encode())
        time.sleep(0.2)
    deadline = time.monotonic() + 10
    while server.metric("specflow_requests_total", endpoint="/v1/completions", status="499") == closed:
        assert time.monotonic() < deadline, "the request was never counted"
        time.sleep(0.05)
    assert server.metric("specflow_requests_total", endpoint="/v1/completions", status="500") == errors
    assert "ClientDisconnect" not in server.log
