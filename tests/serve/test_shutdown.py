"""A plain-decoding server on a checkpoint without a chat template: the clear chat error,
then a SIGINT with requests in flight: short ones finish, a long one ends with what it has
(``finish_reason: "abort"``), the stream closes with ``[DONE]``, and the process exits with 0."""

import json
import signal
import threading
import time

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


def test_a_signal_closes_keep_alive_connections_to_new_requests(tiny_target, tmp_path):
    """After SIGTERM, a client's pooled keep-alive connection takes no new request (uvicorn's own
    shutdown closes idle connections at once, busy ones after their response): the drain ends
    when the requests in flight at the signal end, instead of admitting new ones until the
    shutdown timeout and then aborting them."""
    config = write_serve_config(tmp_path / "serve.yaml", MODEL, target=str(tiny_target), drafter=None)
    server = ServerProcess(config, "--shutdown-timeout", "30").wait_ready()
    body = {"model": MODEL, "prompt": "def main():", "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    events, first = [], threading.Event()
    long = threading.Thread(target=stream, args=(server.url, 1, 3000, events, first))
    try:
        with httpx.Client(base_url=server.url, timeout=60) as pooled:
            assert pooled.post("/v1/completions", json=body).status_code == 200   # the connection stays open
            long.start()
            first.wait()
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(1.0)   # (uvicorn looks for the signal every 0.1 s)
            assert server.proc.poll() is None   # still draining the long request
            with pytest.raises(httpx.TransportError):
                pooled.post("/v1/completions", json=body)
        long.join()
        assert server.proc.wait(60) == 0
    finally:
        server.stop()
    assert events[-1] == "[DONE]"
    assert [c["finish_reason"] for e in events[:-1] for c in e["choices"] if c["finish_reason"]] == ["length"]


def test_a_second_sigint_ends_the_requests_at_once(tiny_target, tmp_path):
    """Ctrl+C twice does not wait out the shutdown timeout: the requests in flight end at once
    with what they have, and the process exits with 0."""
    config = write_serve_config(tmp_path / "serve.yaml", MODEL, target=str(tiny_target), drafter=None)
    server = ServerProcess(config, "--shutdown-timeout", "60").wait_ready()
    events, first = [], threading.Event()
    long = threading.Thread(target=stream, args=(server.url, 4, 3000, events, first))
    try:
        long.start()
        first.wait()
        start = time.monotonic()
        server.proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        server.proc.send_signal(signal.SIGINT)
        assert server.proc.wait(60) == 0
        assert time.monotonic() - start < 20   # (not the 60 s timeout, nor 4 x 3000 tokens)
        long.join()
    finally:
        server.stop()
    assert events[-1] == "[DONE]"
    assert [c["finish_reason"] for e in events[:-1] for c in e["choices"] if c["finish_reason"]] == ["abort"] * 4
