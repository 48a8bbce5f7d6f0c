"""The OpenAI wire format's request bodies, validated, as pydantic models (responses:
specflow.serve.responses).

Request models are strict and closed: a wrong type, an out-of-range value or an unknown field is
a 400 that names the field. Extensions beyond OpenAI's parameters: ``top_k``, ``min_p``,
``ignore_eos``, ``stop_token_ids``, ``repetition_penalty``, ``min_tokens`` (vLLM's meanings) and
``speculative`` (``false`` decodes this request without a drafter).
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

MAX_LOGPROBS = 20   # OpenAI's bound for top_logprobs
MAX_N = 16          # each choice is one engine request, so n costs n batch slots
MAX_STOP = 16
SEED_RANGE = 2**63        # seeds wrap into the range the engine draws its own from (request_seed)
DEFAULT_MAX_TOKENS = 16   # OpenAI's default for /v1/completions


class _Strict(BaseModel):
    """Strict and closed; an explicit ``null`` takes the field's default, as OpenAI's nullable
    parameters do (clients send ``None`` as ``null``)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data):
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(_Strict):
    include_usage: bool = False


class SamplingFields(_Strict):
    """The parameters ``/v1/completions`` and ``/v1/chat/completions`` share."""

    model: str
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, lt=2**31)
    stop_token_ids: list[int] | None = None   # vLLM's: token ids that end a choice, as stop strings do
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=-2**63, lt=2**63)   # any int64, as OpenAI and vLLM take
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    speculative: bool = True
    user: str | None = None           # accepted and ignored, as OpenAI does
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)   # vLLM's, 1 = off
    min_tokens: int = Field(0, ge=0)                 # vLLM's
    logit_bias: dict[str, float] | None = None   # token id (as text) -> bias in [-100, 100]

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (v or {}).items():
            if not (token.isascii() and token.isdigit() and len(token) <= 18):  # (int() refuses 4301 digits)
                raise ValueError(f"logit_bias keys are token ids (at most 18 digits), got {token[:40]!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values are in [-100, 100], got {bias} for token {token}")
        return v

    def token_bias(self) -> dict[int, float] | None:
        """``logit_bias`` keyed by token id (None when empty)."""
        return {int(t): b for t, b in self.logit_bias.items()} if self.logit_bias else None

    @field_validator("stop_token_ids")
    @classmethod
    def _distinct_stop_token_ids(cls, v: list[int] | None) -> list[int] | None:
        # a set: each id once, however often a body repeats it (each one is checked, per request)
        return None if v is None else list(dict.fromkeys(v))

    @field_validator("top_k")
    @classmethod
    def _top_k_zero_is_off(cls, v: int) -> int:
        return -1 if v == 0 else v   # 0 or -1: every token, as vLLM reads them

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: str | list[str] | None) -> list[str] | None:
        stops = [v] if isinstance(v, str) else v
        if stops is not None and (len(stops) > MAX_STOP or not all(stops)):
            raise ValueError(f"stop must be at most {MAX_STOP} non-empty strings")
        return stops

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, v: StreamOptions, info: ValidationInfo) -> StreamOptions:
        if not info.data.get("stream"):   # (a field check, so the error names it)
            raise ValueError("stream_options is only allowed when stream is true")
        return v

    def choice_seed(self, choice: int) -> int | None:
        """Choice ``i`` samples with seed ``seed + i`` wrapped into ``[0, 2^63)``, so that choices
        differ and reproduce whatever int64 the seed is."""
        return None if self.seed is None else (self.seed + choice) % SEED_RANGE


class CompletionRequest(SamplingFields):
    """Body of ``POST /v1/completions``: one prompt (text or token ids) or a list of them."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False   # the prompt before the completion (with logprobs: the prompt's too)
    max_tokens: int | None = Field(DEFAULT_MAX_TOKENS, ge=0)   # 0 with echo: score the prompt only
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: Literal[1] | None = None   # OpenAI's default; more candidates per choice are not supported

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, v):
        if isinstance(v, list) and (not v or any(isinstance(p, list) and not p for p in v)):
            raise ValueError("prompt must not be empty")
        return v

    @field_validator("max_tokens")
    @classmethod
    def _zero_tokens_only_with_echo(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v == 0 and not info.data.get("echo"):
            raise ValueError("max_tokens must be at least 1 (0 only with echo, which returns the prompt alone)")
        return v

    @property
    def max_new_tokens(self) -> int:
        return self.max_tokens   # (never None: an explicit null takes the default, _null_is_the_default)

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list (a single text or token-id prompt becomes a list of one)."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str   # JSON text, as the model wrote it


class ToolCall(_Strict):
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


class ChatMessage(_Strict):
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


class FunctionDefinition(_Strict):
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


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition

    def as_template_input(self) -> dict:
        """The tool as chat templates read it (transformers' ``tools=``): the fields given."""
        return {"type": self.type, "function": self.function.model_dump(exclude_none=True, exclude={"strict"})}


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class ResponseFormat(_Strict):
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
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None   # after tools: its check reads them
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
