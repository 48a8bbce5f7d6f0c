"""The Hermes tool-call parser on its own: the reference on whole texts, and the stream reaching
the same result wherever the text is cut into pieces."""

import json
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from specflow.serve.tool_parser import (
    TOOL_CALL_START, ToolCallStream, parse_tool_call, parse_tool_calls, tool_finish_reason)

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TIME = '{"name": "get_time", "arguments": {"zone": "CET"}}'
CALL_W, CALL_T = ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})


def block(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


# (name, text, parallel, content, calls as (name, arguments))
CASES = [
    ("no tags", "Paris is sunny < 30 degrees.", True, "Paris is sunny < 30 degrees.", []),
    ("empty text", "", True, "", []),
    ("only a call", block(WEATHER), True, None, [CALL_W]),
    ("Qwen2.5: text then two calls", f"Let me check.\n{block(WEATHER)}\n{block(TIME)}", True,
     "Let me check.\n", [CALL_W, CALL_T]),
    ("whitespace before a call is no content", f"\n \n{block(WEATHER)}", True, None, [CALL_W]),
    ("parallel_tool_calls false keeps the first", f"{block(WEATHER)}\n{block(TIME)}", False, None, [CALL_W]),
    ("text after the first call is dropped", f"ok {block(WEATHER)} and then {block(TIME)} done", True,
     "ok ", [CALL_W, CALL_T]),
    ("a block of no JSON is text", f"a {block('{oops')} b", True, f"a {block('{oops')} b", []),
    ("a bad block before a call stays in content", f"a {block('{oops')} {block(TIME)}", True,
     f"a {block('{oops')} ", [CALL_T]),
    ("a bad block after a call is dropped", f"{block(WEATHER)}{block('[1]')}", True, None, [CALL_W]),
    ("arguments not an object", block('{"name": "f", "arguments": "x=1"}'), True,
     block('{"name": "f", "arguments": "x=1"}'), []),
    ("no name", block('{"arguments": {}}'), True, block('{"arguments": {}}'), []),
    ("an open block (cut by max_tokens) is text", f"hm {TOOL_CALL_START}\n" + WEATHER[:20], True,
     f"hm {TOOL_CALL_START}\n" + WEATHER[:20], []),
    ("an open block after a call is dropped", f"{block(WEATHER)}\n{TOOL_CALL_START}\n{{\"na", True,
     None, [CALL_W]),
    ("a start tag inside a block is body", f"<tool_call> {block(WEATHER)}", True, f"<tool_call> {block(WEATHER)}", []),
    ("partial tags are text", "x <tool_cal <tool_call", True, "x <tool_cal <tool_call", []),
    ("non-ASCII arguments", block('{"name": "say", "arguments": {"text": "日本\\u00e9"}}'), True, None,
     [("say", {"text": "日本é"})]),
]


def calls_of(tool_calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in tool_calls]


def streamed(pieces: list[str], parallel: bool) -> tuple[str, list[tuple[str, dict]]]:
    """The content and calls a stream sends for ``pieces``, concatenated."""
    stream, content, calls = ToolCallStream(parallel), "", []
    for piece in pieces:
        text, new = stream.feed(piece)
        content, calls = content + text, calls + new
    content += stream.finish()
    assert stream.num_calls == len(calls)
    return content, calls_of(calls)


@pytest.mark.parametrize("name, text, parallel, content, calls", CASES, ids=[c[0] for c in CASES])
def test_reference_parse(name, text, parallel, content, calls):
    parsed = parse_tool_calls(text, parallel)
    assert parsed.content == content and calls_of(parsed.tool_calls) == calls


@pytest.mark.parametrize("name, text, parallel, content, calls", CASES, ids=[c[0] for c in CASES])
def test_stream_cut_at_every_character_equals_the_reference(name, text, parallel, content, calls):
    """Two pieces cut at each boundary, and one character at a time."""
    expected = (content or "", calls)
    for cut in range(len(text) + 1):
        assert streamed([text[:cut], text[cut:]], parallel) == expected, cut
    assert streamed(list(text), parallel) == expected


def test_call_ids_and_arguments_text():
    """Ids are ``call_`` + 24 hex digits, new for every call; arguments are JSON text of the object."""
    calls = parse_tool_calls(block(WEATHER) * 3).tool_calls
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c.id) for c in calls) and len({c.id for c in calls}) == 3
    assert calls[0].type == "function" and calls[0].function.arguments == '{"city": "Paris"}'
    assert parse_tool_call(' {"name": "f", "arguments": {}, "extra": 1} ').function.arguments == "{}"
    assert parse_tool_call('{"name": "", "arguments": {}}') is None


def test_stream_holds_back_a_possible_tag_and_an_open_block_only():
    stream = ToolCallStream()
    assert stream.feed("Sure <tool") == ("Sure ", [])           # "<tool" may start a call
    assert stream.feed("s are here <") == ("<tools are here ", [])
    assert stream.feed("tool_call>\n" + WEATHER) == ("", [])     # an open block waits for its end
    content, calls = stream.feed("\n</tool_call> bye")
    assert content == "" and calls_of(calls) == [CALL_W] and stream.finish() == ""


def test_finish_reason():
    assert tool_finish_reason("stop", 2) == "tool_calls"
    assert tool_finish_reason("length", 1) == "length"          # cut: the client should know
    assert tool_finish_reason("abort", 1) == "abort"
    assert tool_finish_reason("stop", 0) == "stop"
    assert tool_finish_reason(None, 1) is None                  # a stream's chunks before the last


BODIES = [WEATHER, TIME, "{bad", "[1]", "", '{"name": "f", "arguments": {}}']
SEGMENTS = st.one_of(
    st.builds(lambda ws, body: f"<tool_call>{ws}{body}{ws}</tool_call>", st.sampled_from(["", "\n", " "]),
              st.sampled_from(BODIES)),                                        # whole blocks, good or bad
    st.sampled_from(["<tool_call>", "</tool_call>", "<tool", "<tool_call", "</tool", "<", "\n", " "]),
    st.text(alphabet="<>_/{}ab \nü", max_size=6))


@given(st.lists(SEGMENTS, max_size=8), st.lists(st.integers(0, 1000), max_size=6), st.booleans())
def test_stream_equals_the_reference_for_any_text_and_cuts(segments, cuts, parallel):
    text = "".join(segments)
    bounds = [0, *sorted(c % (len(text) + 1) for c in cuts), len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    parsed = parse_tool_calls(text, parallel)
    assert streamed(pieces, parallel) == (parsed.content or "", calls_of(parsed.tool_calls))
