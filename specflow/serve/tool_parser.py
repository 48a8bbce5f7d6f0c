"""Tool calls in generated text, in the Hermes format (Hermes 2/3, Qwen2.5, Qwen3), as vLLM's
``hermes`` tool-call parser reads them::

    I will look it up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The rule, for the text of one choice:

- a complete ``<tool_call>...</tool_call>`` block whose body is a JSON object with a non-empty
  string ``"name"`` and an object ``"arguments"`` is a call; any other block (not JSON, not a
  call, or still open when the text ends) is plain text;
- the content is the text before the first call, ``None`` when it is only whitespace; text after
  the first call is dropped, except further calls;
- with ``parallel_tool_calls: false`` only the first call counts;
- a text without calls is the content as it is.

``parse_tool_calls`` is the reference, over a whole text. ``ToolCallStream`` reaches the same
result from the text in pieces, as a stream generates it: it sends content as soon as no later
piece can make it part of a call, and each call once its block closes.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from specflow.serve.chat_protocol import FunctionCall, ToolCall

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_CALL_BLOCK = re.compile(re.escape(TOOL_CALL_START) + "(.*?)" + re.escape(TOOL_CALL_END), re.DOTALL)


@dataclass
class ParsedText:
    """A choice's text split into the message's ``content`` and ``tool_calls``."""

    content: str | None
    tool_calls: list[ToolCall]


def parse_tool_call(body: str) -> ToolCall | None:
    """The call in one block's body (between the tags), or None when it holds none. ``arguments``
    is re-serialised with ``json.dumps``' default separators (as vLLM's hermes parser does),
    non-ASCII characters kept; the id is ``call_`` + 24 random hex digits."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not (isinstance(call, dict) and isinstance(call.get("name"), str) and call["name"]
            and isinstance(call.get("arguments"), dict)):
        return None
    arguments = json.dumps(call["arguments"], ensure_ascii=False)
    return ToolCall(id=f"call_{secrets.token_hex(12)}", function=FunctionCall(name=call["name"], arguments=arguments))


def parse_tool_calls(text: str, parallel: bool = True) -> ParsedText:
    """The content and calls of a whole generated text (the module's rule)."""
    calls, content_end = [], len(text)
    for block in TOOL_CALL_BLOCK.finditer(text):
        call = parse_tool_call(block.group(1))
        if call is None:
            continue
        if not calls:
            content_end = block.start()
        calls.append(call)
        if not parallel:
            break
    if not calls:
        return ParsedText(text, [])
    content = text[:content_end]
    return ParsedText(content if content.strip() else None, calls)


def tool_finish_reason(finish_reason: str | None, num_calls: int) -> str | None:
    """``"tool_calls"`` when a choice that made calls ended by itself (EOS or a stop string);
    ``"length"`` and the others stay, so a client sees that the output was cut."""
    return "tool_calls" if num_calls and finish_reason == "stop" else finish_reason


def _tag_prefix_len(text: str) -> int:
    """Length of the longest end of ``text`` that a later piece could complete into the start tag."""
    for k in range(min(len(text), len(TOOL_CALL_START) - 1), 0, -1):
        if text.endswith(TOOL_CALL_START[:k]):
            return k
    return 0


class ToolCallStream:
    """One choice's text in, piece by piece: ``feed`` returns the content and the calls that the
    pieces so far decide, ``finish`` the content held back at the end. Their concatenation equals
    ``parse_tool_calls`` of the whole text (content ``""`` where it has ``None``).

    Held back: an open block (until it closes), an end that may be the start tag's beginning,
    and whitespace before any content (dropped if a call follows, as the reference drops it).
    """

    def __init__(self, parallel: bool = True):
        self.parallel = parallel
        self.num_calls = 0
        self._pending = ""     # undecided text: a possible start tag or an open block
        self._blank = ""       # whitespace-only content so far, not yet sent
        self._content_sent = False

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """The new content and the calls whose blocks closed in ``text`` (with what was held)."""
        pending = self._pending + text
        content, calls = [], []
        while (start := pending.find(TOOL_CALL_START)) >= 0:
            end = pending.find(TOOL_CALL_END, start + len(TOOL_CALL_START))
            if end < 0:
                break   # an open block: wait for its end
            content.append(self._content(pending[:start]))
            call = parse_tool_call(pending[start + len(TOOL_CALL_START):end])
            end += len(TOOL_CALL_END)
            if call is None:
                content.append(self._content(pending[start:end]))
            elif self.parallel or not self.num_calls:
                calls.append(call)
                self.num_calls += 1
            pending = pending[end:]
        decided = start if start >= 0 else len(pending) - _tag_prefix_len(pending)
        content.append(self._content(pending[:decided]))
        self._pending = pending[decided:]
        return "".join(content), calls

    def finish(self) -> str:
        """The content still held when the text ends: an open block or a partial tag is text, and
        leading whitespace is the content when no call came."""
        content = self._content(self._pending)
        self._pending = ""
        if not self.num_calls:
            content, self._blank = content + self._blank, ""
        return content

    def _content(self, text: str) -> str:
        """What of ``text`` (decided, outside any call) to send as content now."""
        if self.num_calls:
            return ""   # after the first call only calls count
        if self._content_sent:
            return text
        self._blank += text
        if not self._blank.strip():
            return ""
        text, self._blank, self._content_sent = self._blank, "", True
        return text
