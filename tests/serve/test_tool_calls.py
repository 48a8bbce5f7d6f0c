"""Function calling end to end, through the real `openai` client, against a server whose model
says what the test scripted (``scripted_model``): tools reach the chat template, the generated
text becomes ``tool_calls`` with and without streaming, and bad tool parameters are 400s that
name the parameter."""

import json

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.serve.scripted_model import make_scripted_checkpoint
from tests.serve.server import ServerProcess, write_serve_config

pytestmark = pytest.mark.xdist_group("serve")
MODEL = "tiny-scripted"
# no generation prompt: the model continues the last message, whose final token picks the script
TEMPLATE = ("{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>{% endif %}"
            "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}")
WEATHER = ["Let me check", " the weather.\n", "<tool", "_call>\n",
           '{"name": "get_weather", "arguments": {"city": "Paris"}}', "\n</tool_call>\n", "<tool_call>\n{",
           '"name": "get_time", "arguments": {"zone": "CET"}}\n', "</tool_call>"]
NOT_A_CALL = ["Checking.", "<tool_call>{'name': 'get_time'}</tool_call>"]   # no JSON: plain text
SCRIPTS = {"<|weather|>": WEATHER, "<|not-a-call|>": NOT_A_CALL}
ASK_WEATHER = [{"role": "user", "content": "Weather in Paris, and the time?<|weather|>"}]
ASK_NOT_A_CALL = [{"role": "user", "content": "Time?<|not-a-call|>"}]
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city now",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}}]
GET_WEATHER, GET_TIME = ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})
CONTENT = "Let me check the weather.\n"

# (name, messages, parameters, content, calls, finish_reason): two choices each, greedy
CASES = [
    ("two calls after text", ASK_WEATHER, {"tools": TOOLS}, CONTENT, [GET_WEATHER, GET_TIME], "tool_calls"),
    ("parallel_tool_calls false", ASK_WEATHER, {"tools": TOOLS, "parallel_tool_calls": False}, CONTENT,
     [GET_WEATHER], "tool_calls"),
    ("cut by max_tokens in the second call", ASK_WEATHER, {"tools": TOOLS, "max_tokens": 7}, CONTENT,
     [GET_WEATHER], "length"),
    ("tool_choice none", ASK_WEATHER, {"tools": TOOLS, "tool_choice": "none"}, "".join(WEATHER), [], "stop"),
    ("no tools", ASK_WEATHER, {}, "".join(WEATHER), [], "stop"),
    ("a block that is no call", ASK_NOT_A_CALL, {"tools": TOOLS}, "".join(NOT_A_CALL), [], "stop"),
]


@pytest.fixture(scope="module")
def scripted_target(tiny_target, tmp_path_factory):
    return make_scripted_checkpoint(tmp_path_factory.mktemp("scripted") / "target", tiny_target, SCRIPTS, TEMPLATE)


@pytest.fixture(scope="module")
def scripted_server(scripted_target):
    config = write_serve_config(scripted_target.parent / "serve.yaml", MODEL, target=str(scripted_target),
                                drafter=None)   # plain decoding: one token per streamed delta
    proc = ServerProcess(config).wait_ready()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(scripted_server):
    return openai.OpenAI(base_url=scripted_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def test_tools_reach_the_chat_template(client, scripted_target):
    """As transformers renders them: the prompt has the reference rendering's length, with
    tool_choice "none" too, and is shorter without tools."""
    tokenizer = AutoTokenizer.from_pretrained(scripted_target)
    rendered = tokenizer.apply_chat_template(ASK_WEATHER, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    expected = len(tokenizer.encode(rendered, add_special_tokens=False))

    def prompt_tokens(**tools) -> int:
        out = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=1, **tools)
        return out.usage.prompt_tokens

    assert prompt_tokens(tools=TOOLS) == prompt_tokens(tools=TOOLS, tool_choice="none") == expected
    assert prompt_tokens() < expected


@pytest.mark.parametrize("name, messages, params, content, calls, finish", CASES, ids=[c[0] for c in CASES])
def test_generated_tool_calls_with_and_without_streaming(client, name, messages, params, content, calls, finish):
    """Each choice's text is parsed on its own; the openai client's stream accumulation gives the
    same messages, and no content delta carries a piece of a tag."""
    kwargs = dict(model=MODEL, messages=messages, n=2, temperature=0.0, **params)
    full = client.chat.completions.create(**kwargs)
    with client.chat.completions.stream(**kwargs) as stream:
        content_deltas = [e.delta for e in stream if e.type == "content.delta"]
        streamed = stream.current_completion_snapshot   # (get_final_completion refuses "length")
    for out in (full, streamed):
        assert [c.index for c in out.choices] == [0, 1]
        for choice in out.choices:
            assert choice.message.content == content and calls_of(choice.message) == calls
            assert choice.finish_reason == finish
    if calls:
        ids = [c.id for choice in full.choices + streamed.choices for c in choice.message.tool_calls]
        assert all(i.startswith("call_") for i in ids) and len(set(ids)) == len(ids)
        assert not any("<" in d for d in content_deltas)   # "<tool" came as a token of its own
    else:
        assert all(c.message.tool_calls is None for c in full.choices + streamed.choices)


CHAT = {"model": MODEL, "messages": ASK_WEATHER}
TOOL = TOOLS[0]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# (name, body, the param the error names, a fragment of its message)
BAD_TOOLS = [
    ("unknown tool type", {**CHAT, "tools": [{"type": "web_search"}]}, "tools.0.type", "'function'"),
    ("empty tools", {**CHAT, "tools": []}, "tools", "at least 1"),
    ("duplicate tool names", {**CHAT, "tools": [TOOL, TOOL]}, "tools", "get_weather appear more than once"),
    ("tool_choice without tools", {**CHAT, "tool_choice": "auto"}, "tool_choice", "only allowed with"),
    ("tool_choice naming no tool", {**CHAT, "tools": [TOOL], "tool_choice": {**NAMED, "function": {"name": "f"}}},
     "tool_choice", "'f', which is not in tools (get_weather)"),
    ("tool_choice required", {**CHAT, "tools": [TOOL], "tool_choice": "required"}, "tool_choice",
     "'required' needs guided decoding"),
    ("tool_choice naming a tool", {**CHAT, "tools": [TOOL], "tool_choice": NAMED}, "tool_choice",
     "naming a function needs guided decoding"),
    ("strict function", {**CHAT, "tools": [{**TOOL, "function": {**TOOL["function"], "strict": True}}]},
     "tools.0.function.strict", "needs guided decoding"),
]


@pytest.mark.parametrize("name, body, param, fragment", BAD_TOOLS, ids=[c[0] for c in BAD_TOOLS])
def test_bad_tool_parameters_are_400s_naming_them(scripted_server, name, body, param, fragment):
    response = httpx.post(scripted_server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and fragment in error["message"], error


def test_a_streamed_turn_goes_back_into_the_conversation(client):
    """The usual agent loop over the openai client's stream helper: the accumulated assistant
    message goes back into ``messages`` as it is, with the ``index`` its stream accumulation
    leaves on each tool call (a streaming field, ignored in a request as vLLM ignores it)."""
    with client.chat.completions.stream(model=MODEL, messages=ASK_WEATHER, tools=TOOLS, temperature=0.0) as stream:
        for _ in stream:
            pass
        turn = stream.get_final_completion().choices[0].message
    assert calls_of(turn) == [GET_WEATHER, GET_TIME]
    assert turn.tool_calls[0].model_dump()["index"] == 0   # what the client sends back
    results = [{"role": "tool", "tool_call_id": c.id, "content": "ok"} for c in turn.tool_calls]
    out = client.chat.completions.create(model=MODEL, messages=[*ASK_WEATHER, turn, *results], tools=TOOLS,
                                         max_tokens=4)
    assert out.choices[0].finish_reason == "stop"   # no script follows the tool's "ok": EOS
