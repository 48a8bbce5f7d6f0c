"""A plain-decoding server on a checkpoint without a chat template: the clear chat error,
then a SIGINT with requests in flight: short ones finish, a long one ends with what it has
(``finish_reason: "abort"``), the stream closes with ``[DONE]``, and the process exits with 0."""

import json
import signal
import threading

import httpx
import pytest

from tests.serve.server import ServerProcess, write_serve_config

pytestmark = pytest.mark.xdist_group("serve")
MODEL = "tiny-plain"
SHUTDOWN_TIMEOUT = 4   # seconds in-flight requests get after SIGINT: plenty for 40 tokens, not 8 x 4000


@pytest.fixture(scope="module")
def plain_server(tiny_target, tmp_path_factory):
    config = write_serve_config(tmp_path_factory.mktemp("serve-plain") / "serve.yaml", MODEL,
                                target=str(tiny_target), drafter=None)
    proc = ServerProcess(config, "--shutdown-timeout", str(SHUTDOWN_TIMEOUT)).wait_ready()
    yield proc
    proc.stop()


def test_chat_without_a_template_is_a_clear_error(plain_server):
    response = httpx.post(plain_server.url + "/v1/chat/completions",
                          json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "chat_template_missing" and "has no chat template" in error["message"]
    assert "/v1/completions" in error["message"]   # the way out


def test_plain_decoding_reports_accept_length_one(plain_server):
    body = {"model": MODEL, "prompt": "x = 1", "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    usage = httpx.post(plain_server.url + "/v1/completions", json=body).json()["usage"]
    assert usage["accept_length"] == {"steps": 5, "mean": 1.0, "histogram": {"1": 5}}


def stream(url: str, n: int, max_tokens: int, events: list[dict | str], first: threading.Event) -> None:
    body = {"model": MODEL, "prompt": "def main():", "n": n, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                first.set()


def test_sigint_finishes_short_requests_and_ends_long_ones(plain_server):
    runs = {"short-1": (1, 40), "short-2": (1, 40), "long": (8, 4000)}   # (n, max_tokens)
    events = {name: [] for name in runs}
    started = {name: threading.Event() for name in runs}
    threads = [threading.Thread(target=stream, args=(plain_server.url, *runs[name], events[name], started[name]))
               for name in runs]
    for t in threads:
        t.start()
    for e in started.values():
        e.wait()
    assert plain_server.stop(signal.SIGINT) == 0
    for t in threads:
        t.join()
    for name, (n, _) in runs.items():
        assert events[name][-1] == "[DONE]", name
        finish = [c["finish_reason"] for e in events[name][:-1] for c in e["choices"] if c["finish_reason"]]
        assert finish == ["abort" if name == "long" else "length"] * n, name
    log = plain_server.log
    assert "Traceback" not in log and "Application shutdown complete" in log
