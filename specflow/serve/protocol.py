"""The OpenAI wire format's request bodies, validated, as pydantic models: the fields both
endpoints share and the completions body (the chat body: specflow.serve.chat_protocol;
responses: specflow.serve.responses).

Request models are strict and closed: a wrong type, an out-of-range value or an unknown field is
a 400 that names the field. Extensions beyond OpenAI's parameters: ``top_k``, ``min_p``,
``ignore_eos``, ``stop_token_ids``, ``repetition_penalty``, ``min_tokens`` (vLLM's meanings) and
``speculative`` (``false`` decodes this request without a drafter).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

MAX_LOGPROBS = 20   # OpenAI's bound for top_logprobs
MAX_N = 16          # each choice is one engine request, so n costs n batch slots
MAX_STOP = 16
SEED_RANGE = 2**63        # seeds wrap into the range the engine draws its own from (request_seed)
DEFAULT_MAX_TOKENS = 16   # OpenAI's default for /v1/completions


class StrictModel(BaseModel):
    """Strict and closed; an explicit ``null`` takes the field's default, as OpenAI's nullable
    parameters do (clients send ``None`` as ``null``)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data):
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(StrictModel):
    include_usage: bool = False


class SamplingFields(StrictModel):
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
