"""The OpenAI wire format's response bodies, as pydantic models (requests:
specflow.serve.protocol and chat_protocol), and a response's usage from its requests' outputs.
Beyond OpenAI's fields: ``usage.accept_length``, tokens committed per speculative step."""

from __future__ import annotations

import collections
from typing import Literal

from pydantic import BaseModel, model_serializer

from specflow.request import RequestOutput
from specflow.serve.chat_protocol import FunctionCall, ToolCall

class AcceptLengthStats(BaseModel):
    """Tokens committed by each speculative step (accepted drafts + bonus), over all choices."""

    steps: int
    mean: float
    histogram: dict[str, int]   # accept length -> number of steps


class PromptTokensDetails(BaseModel):
    cached_tokens: int   # prompt tokens whose K/V the prefix cache held (OpenAI's prompt caching)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    accept_length: AcceptLengthStats


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]          # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ToolCallChunk(BaseModel):
    """One call in a stream's ``delta.tool_calls``: whole, arguments included, once its block closed."""

    index: int   # the call's place among the choice's calls
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatDelta(BaseModel):
    """What a chunk adds to the message: only the fields it carries (the role in the first)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallChunk] | None = None

    @model_serializer(mode="wrap")
    def _carried(self, handler) -> dict:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specflow"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error envelope: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def usage(outputs: list[RequestOutput], prompt_tokens: int, cached_tokens: int) -> Usage:
    """Token counts plus the accept-length statistics of every choice's speculative steps."""
    completion = sum(len(o.token_ids) for o in outputs)
    steps = [a for o in outputs for a in o.accept_lengths]
    histogram = collections.Counter(steps)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion,
                 total_tokens=prompt_tokens + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
                 accept_length=AcceptLengthStats(
                     steps=len(steps), mean=sum(steps) / len(steps) if steps else 0.0,
                     histogram={str(k): histogram[k] for k in sorted(histogram)}))


def cached(outputs: list[RequestOutput], n: int) -> int:
    """Prompt tokens the prefix cache held, once per prompt: of its ``n`` choices, the fewest (the
    later choices of a new prompt read the pages the first one wrote)."""
    return sum(min(o.num_cached_tokens for o in outputs[i:i + n]) for i in range(0, len(outputs), n))
