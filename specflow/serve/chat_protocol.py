"""The chat endpoint's request body, validated: messages, tool calls, tools and their choice
(the shared fields and the completions body: specflow.serve.protocol)."""

from __future__ import annotations

import json
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from specflow.serve.protocol import MAX_LOGPROBS, SamplingFields, StrictModel


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class FunctionCall(StrictModel):
    name: str
    arguments: str   # JSON text, as the model wrote it


class ToolCall(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall

    def as_template_input(self) -> dict:
        """The call as chat templates read it: ``arguments`` a mapping (transformers' convention,
        which vLLM follows). Text that is no JSON object becomes ``{}``, as in vLLM, so that a
        conversation holding one malformed call can go on."""
        try:
            arguments = json.loads(self.function.arguments)
        except ValueError:
            arguments = {}
        return {"id": self.id, "type": self.type, "function": {
            "name": self.function.name, "arguments": arguments if isinstance(arguments, dict) else {}}}


class ToolCallParam(ToolCall):
    """A call of an assistant message in a request. ``index`` is a streaming field: the openai
    client's stream accumulation (``client.chat.completions.stream``) leaves it on each call of
    the message it builds, which agent loops send back as they got it; it is ignored, as vLLM
    ignores it."""

    index: int | None = None


class ChatMessage(StrictModel):
    """One message of a conversation. ``tool_calls`` (assistant) and ``tool_call_id`` (tool) carry
    a tool-use conversation to the chat template."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _fields_fit_the_role(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a{'n' if self.role == 'assistant' else ''} {self.role} message needs content"
                             + (" (or tool_calls)" if self.role == "assistant" else ""))
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("a tool message needs the tool_call_id of the call it answers, and only it takes one")
        return self

    def as_template_input(self) -> dict:
        """The message as ``apply_chat_template`` takes it: the content as one text, and the
        optional fields only when given."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.as_template_input() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


NO_GUIDED_DECODING = "needs guided decoding, which this server does not have"
AUTO_OR_NONE = "use tool_choice 'auto' (the model decides whether to call a tool) or 'none'"


class FunctionDefinition(StrictModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict | None = None   # a JSON Schema of the arguments
    strict: bool = False

    @field_validator("strict")
    @classmethod
    def _not_strict(cls, v: bool) -> bool:
        if v:
            raise ValueError(f"strict function calling {NO_GUIDED_DECODING}; leave strict false")
        return v


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition

    def as_template_input(self) -> dict:
        """The tool as chat templates read it (transformers' ``tools=``): the fields given."""
        return {"type": self.type, "function": self.function.model_dump(exclude_none=True, exclude={"strict"})}


class FunctionName(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: FunctionName


class ResponseFormat(StrictModel):
    """OpenAI's ``response_format``: "text" (the default) is what the model writes anyway; JSON
    mode and JSON schemas would need guided decoding, so they are refused, naming that."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict | None = None

    @model_validator(mode="after")
    def _text_only(self):
        if self.type != "text":
            raise ValueError(f"response_format '{self.type}' {NO_GUIDED_DECODING}; leave it 'text'")
        return self


class ChatCompletionRequest(SamplingFields):
    """Body of ``POST /v1/chat/completions``; ``max_tokens`` defaults to the rest of the context.

    ``tools`` reach the chat template; with ``tool_choice`` "auto" (the default when tools are
    given) the generated text is parsed for Hermes-format tool calls, with "none" it is not.
    "required" and a named function would need guided decoding: they are refused.
    """

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(None, min_length=1)
    # (after tools: its check reads them)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None   # "text" only

    @field_validator("tools")
    @classmethod
    def _unique_tool_names(cls, v: list[Tool]) -> list[Tool]:
        names = [t.function.name for t in v]
        if repeated := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"tool names must be unique; {', '.join(repeated)} appear more than once")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_fits_tools(cls, v: str | NamedToolChoice, info: ValidationInfo) -> str | NamedToolChoice:
        tools = info.data.get("tools")   # absent when not given, or when invalid
        if tools is None:
            raise ValueError("tool_choice is only allowed with a valid tools list")
        if isinstance(v, NamedToolChoice):
            names = [t.function.name for t in tools]
            if v.function.name not in names:
                raise ValueError(f"tool_choice names the function '{v.function.name}', which is not in tools "
                                 f"({', '.join(names)})")
            raise ValueError(f"tool_choice naming a function {NO_GUIDED_DECODING}; {AUTO_OR_NONE}")
        if v == "required":
            raise ValueError(f"tool_choice 'required' {NO_GUIDED_DECODING}; {AUTO_OR_NONE}")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, v: int, info: ValidationInfo) -> int:
        if not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def parses_tool_calls(self) -> bool:
        """Whether the generated text is parsed for tool calls: tools given, tool_choice not "none"."""
        return self.tools is not None and self.tool_choice != "none"
