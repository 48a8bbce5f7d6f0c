"""Requests in: an OpenAI request's prompts as token ids and its choices' SamplingParams, each
value the server refuses a 4xx ``ApiError`` naming it, before anything reaches the engine."""

from __future__ import annotations

import asyncio
import copy

from specflow.engine import SpecEngine
from specflow.sampling import SamplingParams
from specflow.serve.chat_protocol import ChatCompletionRequest
from specflow.serve.protocol import CompletionRequest, SamplingFields
from specflow.serve.responses import error_body


class ApiError(Exception):
    """A request the server refuses; rendered as OpenAI's ``{"error": {...}}`` with ``status``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.body = error_body(message, type, param, code)


class RequestInputs:
    """The checks and conversions of one server's requests."""

    def __init__(self, engine: SpecEngine, model_name: str, max_sequences: int):
        self.engine = engine
        self.model_name = model_name
        self.max_sequences = max_sequences   # sequences (prompts x n) one request may put in the engine
        self.tokenizer = engine.tokenizer
        # a request's context: the model's, or the KV cache's when that holds fewer tokens (as vLLM's
        # max_model_len); /v1/models reports it and max_tokens defaults to its rest
        max_position, kv_tokens = engine.model.config.max_position_embeddings, engine.scheduler.max_request_tokens()
        self.context_len = min(max_position, kv_tokens)
        self._context_holder = "the KV cache" if kv_tokens < max_position else "the model"
        # a text longer than this cannot fit the context, whatever it tokenizes to (x 4: a normalizer
        # may shrink it): refused before tokenizing, which costs seconds a megabyte
        self.longest_token = max(map(len, self.tokenizer.get_vocab()))
        self.max_prompt_chars = 4 * self.context_len * self.longest_token

    def check_model(self, name: str) -> None:
        """404 (OpenAI's model_not_found) unless ``name`` is the served model."""
        if name != self.model_name:
            raise ApiError(404, f"The model '{name}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")

    def check_num_sequences(self, num_prompts: int, n: int) -> None:
        """400 unless the request's sequences (each prompt's ``n`` choices, one engine request
        each) number at most ``limits.max_sequences``."""
        if num_prompts * n > self.max_sequences:
            raise ApiError(400, f"this request asks for {num_prompts} prompt(s) x n={n} = {num_prompts * n} "
                                f"sequences; this server generates at most {self.max_sequences} per request "
                                "(limits.max_sequences)", param="n" if n > 1 else "prompt")

    async def prompt_ids(self, body: CompletionRequest) -> list[list[int]]:
        """Each prompt's token ids. Tokenizing runs on a worker thread: a long text would hold up
        the event loop, and every stream on it, for as long as it takes."""
        prompts = body.prompts()
        self.check_num_sequences(len(prompts), body.n)

        for prompt in prompts:
            if isinstance(prompt, str):
                self.check_text(prompt, "prompt")
        return await asyncio.to_thread(lambda: [self.engine.encode(p) for p in prompts])

    def render_chat(self, body: ChatCompletionRequest) -> list[int]:
        """The prompt token ids of a conversation, through the tokenizer's chat template (called on
        a worker thread, as tokenizing is)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ApiError(400, f"the model '{self.model_name}' has no chat template; add a 'chat_template' "
                                "to its tokenizer_config.json, or use /v1/completions with a plain prompt",
                           param="messages", code="chat_template_missing")
        tools = None if body.tools is None else [t.as_template_input() for t in body.tools]
        try:
            text = self.tokenizer.apply_chat_template([m.as_template_input() for m in body.messages], tools=tools,
                                                      tokenize=False, add_generation_prompt=True)
        except Exception as e:   # the checkpoint's own template code failed on these messages
            raise ApiError(400, f"the chat template of '{self.model_name}' cannot render these messages: "
                                f"{type(e).__name__}: {e}", param="messages") from None
        self.check_text(text, "messages")   # (tools' strings reach the text too)
        return self.tokenizer.encode(text, add_special_tokens=False)  # the template wrote any BOS itself

    def check_context(self, ids: list[int], max_tokens: int, prompt_param: str, tokens_param: str) -> None:
        """400 (OpenAI's context_length_exceeded) unless the prompt and ``max_tokens`` fit the
        context, naming the prompt when it leaves no room for a token, else ``tokens_param``."""
        if len(ids) + max_tokens <= self.context_len:
            return
        raise ApiError(400, f"{prompt_param} ({len(ids)} tokens) + {tokens_param} ({max_tokens}) exceeds this "
                            f"server's context length ({self.context_len} tokens, what {self._context_holder} holds)",
                       param=prompt_param if len(ids) >= self.context_len else tokens_param,
                       code="context_length_exceeded")

    def check_text(self, text: str, param: str) -> None:
        """400 unless ``text`` is short enough that its tokens could fit the context, and valid
        Unicode (JSON's ``\\ud800`` escapes decode to lone surrogates, which no tokenizer takes)."""
        if len(text) > self.max_prompt_chars:
            raise ApiError(400, f"{param} has {len(text)} characters, far more than the context "
                                f"({self.context_len} tokens of at most {self.longest_token} characters) holds",
                           param=param)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ApiError(400, f"{param} holds a lone UTF-16 surrogate (U+{ord(e.object[e.start]):04X} at character "
                                f"{e.start}), which is not valid Unicode text", param=param) from None

    def params(self, body: SamplingFields, max_tokens: int, logprobs: int | None,
               prompt_logprobs: int | None = None) -> list[SamplingParams]:
        """Each of the ``n`` choices' SamplingParams; a value they refuse (a ``min_tokens`` past
        the request's max tokens, a ``logit_bias`` token past the vocabulary) is a 400 naming it.
        They are built and checked once, on the event loop, and copied for each choice with its
        seed: a check costs as much as the request's ``stop_token_ids`` and ``logit_bias`` hold."""
        try:
            params = SamplingParams(
                temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, min_p=body.min_p,
                max_tokens=max_tokens, seed=body.choice_seed(0), stop=body.stop,
                stop_token_ids=body.stop_token_ids or [],
                ignore_eos=body.ignore_eos, speculative=body.speculative, logprobs=logprobs,
                prompt_logprobs=prompt_logprobs, logit_bias=body.token_bias(),
                frequency_penalty=body.frequency_penalty, presence_penalty=body.presence_penalty,
                repetition_penalty=body.repetition_penalty, min_tokens=body.min_tokens)
            params.check_vocab(self.engine.model.config.vocab_size)
        except ValueError as e:   # its message starts with the field's name
            raise ApiError(400, str(e), param=str(e).split()[0]) from None
        choices = [params] + [copy.copy(params) for _ in range(body.n - 1)]
        for i, choice in enumerate(choices):
            choice.seed = body.choice_seed(i)   # (a seed in range, or None: nothing to check again)
        return choices
