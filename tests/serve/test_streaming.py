"""When stream chunks go out, on a plain-decoding server with one batch slot, so that a request
waits in the queue for as long as a test holds the slot."""

import json
import threading
import time

import httpx
import pytest

from tests.serve.conftest import MODEL
from tests.serve.server import ServerProcess, write_serve_config

pytestmark = pytest.mark.xdist_group("serve")


@pytest.fixture(scope="module")
def one_slot_server(chat_target, tmp_path_factory):
    config = write_serve_config(tmp_path_factory.mktemp("serve-one-slot") / "serve.yaml", MODEL,
                                target=str(chat_target), drafter=None, max_batch_size=1)
    proc = ServerProcess(config).wait_ready()
    yield proc
    proc.stop()


def test_a_chat_stream_starts_with_its_first_token(one_slot_server):
    """The role chunk goes out when the choice has its first token, as vLLM and SGLang send it,
    not while the request still waits: benchmark clients (`vllm bench serve`) take the first
    chunk with choices as the time to first token."""
    url = one_slot_server.url
    blocker = {"model": MODEL, "prompt": "x", "max_tokens": 4000, "temperature": 0.0, "ignore_eos": True,
               "stream": True}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "n": 2}
    events: list[str] = []

    def read_chat() -> None:
        with httpx.stream("POST", url + "/v1/chat/completions", json=chat, timeout=120) as response:
            events.extend(line[6:] for line in response.iter_lines() if line.startswith("data: "))

    reader = threading.Thread(target=read_chat)
    with httpx.stream("POST", url + "/v1/completions", json=blocker, timeout=120) as held:
        lines = held.iter_lines()
        next(line for line in lines if line.startswith("data: "))   # it runs: the one batch slot is taken
        reader.start()
        for _ in range(600):
            if one_slot_server.metric("specflow_queue_length") == 2:   # both choices wait
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the chat request never queued")
        time.sleep(0.5)
        assert events == [], "a chunk went out before the request had a token"
    # closing the blocker's stream aborts it; the chat request runs
    reader.join(120)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["delta"]["role"] for c in chunks[:2]] == ["assistant", "assistant"]
    assert {c["choices"][0]["index"] for c in chunks[:2]} == {0, 1}
    assert all(c["choices"][0]["delta"]["content"] == "" for c in chunks[:2])
    # as OpenAI streams them: a delta holds only what it carries, and no usage was asked for
    assert all(set(c["choices"][0]["delta"]) <= {"content"} and "usage" not in c for c in chunks[2:])
    texts = ["", ""]
    for c in chunks:
        texts[c["choices"][0]["index"]] += c["choices"][0]["delta"].get("content", "")
    assert all(texts)
