"""``/v1/completions`` and ``/v1/chat/completions``: OpenAI requests in, engine requests out, and
engine deltas back as one JSON response or a stream of server-sent events."""

from __future__ import annotations

import asyncio
import collections
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from specflow.request import RequestOutput
from specflow.logprobs import TokenLogprob
from specflow.sampling import SamplingParams
from specflow.serve.engine_loop import Delta, EngineLoop, EngineNotRunning, Submission
from specflow.serve.inputs import ApiError, RequestInputs
from specflow.serve.chat_protocol import ChatCompletionRequest
from specflow.serve.protocol import CompletionRequest, SamplingFields
from specflow.serve.responses import (
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse, ChatDelta,
    ChatLogprobs, ChatTokenLogprob, CompletionChoice, CompletionLogprobs, CompletionResponse, ToolCallChunk,
    TopLogprob, cached, error_body, usage)
from specflow.serve.token_bytes import TextOffsets, TokenBytes
from specflow.serve.tool_parser import ToolCallStream, parse_tool_calls, tool_finish_reason

CLIENT_CLOSED = 499  # nginx's status for a client that closed the connection before the response


def sse(chunk: BaseModel | dict, exclude: set[str] | None = None) -> str:
    """One server-sent event carrying a JSON chunk (a model's without the ``exclude`` fields)."""
    body = chunk.model_dump_json(exclude=exclude) if isinstance(chunk, BaseModel) else json.dumps(chunk)
    return f"data: {body}\n\n"


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class OpenAIServing:
    """The two generation endpoints over one engine loop."""

    def __init__(self, loop: EngineLoop, model_name: str, max_sequences: int):
        self.loop = loop
        self.model_name = model_name
        self.tokenizer = loop.engine.tokenizer
        self.inputs = RequestInputs(loop.engine, model_name, max_sequences)
        self._token_text: dict[int, str] = {}
        self._bytes = TokenBytes(self.tokenizer)

    # ----------------------------------------------------------------------------------------
    # endpoints

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self.inputs.check_model(body.model)
        prompts = await self.inputs.prompt_ids(body)
        # echo with max_tokens 0 scores the prompt: the engine still draws a token, which is not shown
        generates, max_tokens = body.max_new_tokens > 0, max(1, body.max_new_tokens)
        for ids in prompts:
            self.inputs.check_context(ids, max_tokens, "prompt", "max_tokens")
        prompt_logprobs = body.logprobs if body.echo else None
        per_choice = self.inputs.params(body, max_tokens, body.logprobs, prompt_logprobs)
        if not body.stream:  # a prompt's first choice scores it for all n (streamed, each needs its own at once)
            for p in per_choice[1:]:   # (copies of the first: nothing to check again)
                p.prompt_logprobs = None
        # every prompt's choices share these n SamplingParams: nothing writes them from here on
        choices = [(ids, params) for ids in prompts for params in per_choice]
        sub = await self._submit(choices, "prompt")
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        prompt_tokens = sum(len(p) for p in prompts)
        echoed = [p if isinstance(p, str) else self.loop.engine.decode(p) for p in body.prompts()] if body.echo else []
        # an echoed text prompt is the text as sent, special tokens written in it too (their text takes room)
        as_sent = [isinstance(p, str) for p in body.prompts()]
        offsets = collections.defaultdict(lambda: TextOffsets(self._bytes))   # choice -> its text offsets
        started: set[int] = set()   # choices whose first chunk was sent (streaming)

        def choice(index: int, text: str, token_ids: list[int], logprobs: list[TokenLogprob] | None,
                   finish_reason: str | None, prompt_logprobs: list[TokenLogprob | None] | None) -> CompletionChoice:
            """Choice ``index``'s new text, tokens and logprobs as the client sees them: none of its
            own when it only scores the prompt (max_tokens 0); with echo, its prompt's before its
            first piece."""
            if not generates:
                text, token_ids, logprobs = "", [], None if logprobs is None else []
                finish_reason = None if finish_reason is None else "length"
            shown = 0   # leading tokens whose text is in the text even if special: a text prompt echoed as sent
            if body.echo and index not in started:
                started.add(index)
                prompt = prompts[index // body.n]
                text, token_ids = echoed[index // body.n] + text, prompt + token_ids
                shown = len(prompt) if as_sent[index // body.n] else 0
                if logprobs is not None:   # (a choice cancelled before its prefill has no prompt logprobs: nulls)
                    scored = prompt_logprobs or []
                    logprobs = scored + [None] * (len(prompt) - len(scored)) + logprobs
            lp = None if logprobs is None else self._completion_logprobs(token_ids, logprobs, offsets[index], shown)
            return CompletionChoice(index=index, text=text, finish_reason=finish_reason, logprobs=lp)

        def chunk(d: Delta) -> CompletionResponse:
            return CompletionResponse(id=rid, created=created, model=self.model_name, choices=[
                choice(d.index, d.text, d.token_ids, d.logprobs, d.finish_reason, d.prompt_logprobs)])

        def usage_chunk(outs: list[RequestOutput]) -> CompletionResponse:
            return CompletionResponse(id=rid, created=created, model=self.model_name, choices=[],
                                      usage=usage(outs if generates else [], prompt_tokens, cached(outs, body.n)))

        if body.stream:
            return self._stream(sub, [], chunk, usage_chunk if _include_usage(body) else None)
        outs = await self._collect(sub, request)
        if outs is None:
            return Response(status_code=CLIENT_CLOSED)
        return _json_response(CompletionResponse(
            id=rid, created=created, model=self.model_name,
            usage=usage(outs if generates else [], prompt_tokens, cached(outs, body.n)),
            choices=[choice(i, o.text, o.token_ids, o.logprobs, o.finish_reason,
                            outs[i - i % body.n].prompt_logprobs) for i, o in enumerate(outs)]))

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        self.inputs.check_model(body.model)
        self.inputs.check_num_sequences(1, body.n)
        ids = await asyncio.to_thread(self.inputs.render_chat, body)
        max_tokens = body.max_new_tokens or max(1, self.inputs.context_len - len(ids))
        self.inputs.check_context(ids, max_tokens, "messages",
                            "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens")
        top_n = (body.top_logprobs or 0) if body.logprobs else None
        sub = await self._submit([(ids, params) for params in self.inputs.params(body, max_tokens, top_n)],
                                 "messages")
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        parsers = [ToolCallStream(body.parallel_tool_calls) for _ in range(body.n)] if body.parses_tool_calls else None

        def chunk(d: Delta) -> ChatCompletionChunk | None:
            lp = None if d.logprobs is None else self._chat_logprobs(d.logprobs)
            delta, finish = ChatDelta(content=d.text), d.finish_reason
            if parsers is not None:
                delta, finish = _tool_call_delta(parsers[d.index], d)
                if delta.content is None and delta.tool_calls is None and finish is None and lp is None:
                    return None   # all of this delta's text is held back
            return ChatCompletionChunk(id=rid, created=created, model=self.model_name, choices=[
                ChatChunkChoice(index=d.index, delta=delta, logprobs=lp, finish_reason=finish)])

        def usage_chunk(outs: list[RequestOutput]) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=rid, created=created, model=self.model_name, choices=[],
                                       usage=usage(outs, len(ids), cached(outs, body.n)))

        if body.stream:
            first = [ChatCompletionChunk(id=rid, created=created, model=self.model_name, choices=[
                ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))]) for i in range(body.n)]
            return self._stream(sub, first, chunk, usage_chunk if _include_usage(body) else None)
        outs = await self._collect(sub, request)
        if outs is None:
            return Response(status_code=CLIENT_CLOSED)

        def choice(i: int, o: RequestOutput) -> ChatChoice:
            message, finish = AssistantMessage(content=o.text), o.finish_reason
            if body.parses_tool_calls:
                parsed = parse_tool_calls(o.text, body.parallel_tool_calls)
                message = AssistantMessage(content=parsed.content, tool_calls=parsed.tool_calls or None)
                finish = tool_finish_reason(finish, len(parsed.tool_calls))
            return ChatChoice(index=i, message=message, finish_reason=finish,
                              logprobs=None if o.logprobs is None else self._chat_logprobs(o.logprobs))

        return _json_response(ChatCompletionResponse(
            id=rid, created=created, model=self.model_name, usage=usage(outs, len(ids), cached(outs, body.n)),
            choices=[choice(i, o) for i, o in enumerate(outs)]))

    async def _submit(self, choices: list[tuple[list[int], SamplingParams]], param: str) -> Submission:
        try:
            return await self.loop.submit(choices)
        except ValueError as e:   # the engine's own check: context length, KV cache size, vocabulary
            raise ApiError(400, str(e), param=param) from None
        except EngineNotRunning:
            raise
        except Exception:   # (logged by the engine thread, which serves the other requests on)
            raise ApiError(500, "the engine failed to add the request; see the server log",
                           type="server_error") from None

    # ----------------------------------------------------------------------------------------
    # responses out

    async def _collect(self, sub: Submission, request: Request) -> list[RequestOutput] | None:
        """Every choice's final output, or None when the client disconnected first (its requests
        are aborted at once)."""
        outs: dict[int, RequestOutput] = {}

        async def gather() -> None:
            while len(outs) < len(sub.choices):
                d = await sub.deltas.get()
                if d.finish_reason == "error":
                    raise ApiError(500, "the engine failed while generating; see the server log",
                                   type="server_error")
                if d.output is not None:
                    outs[d.index] = d.output

        work, watch = asyncio.ensure_future(gather()), asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            work.cancel()
            if len(outs) < len(sub.choices):
                self.loop.abort(sub)
        if work.done() and not work.cancelled() and work.exception() is not None:
            raise work.exception()
        return [outs[i] for i in range(len(sub.choices))] if len(outs) == len(sub.choices) else None

    def _stream(self, sub: Submission, first: list[BaseModel], chunk: Callable[[Delta], BaseModel | None],
                final: Callable[[list[RequestOutput]], BaseModel] | None) -> StreamingResponse:
        return StreamingResponse(self._events(sub, first, chunk, final), media_type="text/event-stream")

    async def _events(self, sub: Submission, first: list[BaseModel], chunk: Callable[[Delta], BaseModel | None],
                      final: Callable[[list[RequestOutput]], BaseModel] | None) -> AsyncIterator[str]:
        """Server-sent events until every choice finished, then ``[DONE]``; a delta that ``chunk``
        turns into None sends nothing. The ``first`` chunks (the chat role) go out with the first
        delta, as vLLM and SGLang send them: clients time the first token by the first chunk, and
        a request may wait in the queue for long. If the client goes away, Starlette cancels this
        generator mid-await and ``finally`` aborts the requests at once. Chunks carry ``usage``
        (null but in the ``final`` one) only when the client asked for it, as OpenAI sends them."""
        outs: dict[int, RequestOutput] = {}
        exclude = None if final is not None else {"usage"}
        try:
            while len(outs) < len(sub.choices):
                d = await sub.deltas.get()
                if d.finish_reason == "error":
                    yield sse(error_body("the engine failed while generating; see the server log", "server_error"))
                    return
                for c in first:
                    yield sse(c, exclude)
                first = []
                if d.output is not None:
                    outs[d.index] = d.output
                if (d.text or d.finish_reason or d.logprobs or d.prompt_logprobs) and (c := chunk(d)) is not None:
                    yield sse(c, exclude)
            if final is not None:
                yield sse(final([outs[i] for i in range(len(sub.choices))]))
            yield "data: [DONE]\n\n"
        finally:
            if len(outs) < len(sub.choices):
                self.loop.abort(sub)

    def _text(self, token_id: int) -> str:
        if token_id not in self._token_text:
            self._token_text[token_id] = self.tokenizer.decode([token_id])
        return self._token_text[token_id]

    def _completion_logprobs(self, token_ids: list[int], logprobs: list[TokenLogprob | None],
                             offsets: TextOffsets, shown: int = 0) -> CompletionLogprobs:
        """Legacy completions format: each token's string, log-probability, top alternatives
        (plus the chosen token) keyed by string, and its character offset in the choice's text
        (``offsets``, which walks it; the first ``shown`` tokens' text is there even when they are
        special: an echoed text prompt); None for an echoed prompt's first token."""
        tokens = [self._text(t) for t in token_ids]
        return CompletionLogprobs(
            tokens=tokens, token_logprobs=[None if lp is None else lp.logprob for lp in logprobs],
            text_offset=[offsets(t, i < shown) for i, t in enumerate(token_ids)],
            top_logprobs=[None if lp is None else {**{self._text(t): v for t, v in lp.top}, tok: lp.logprob}
                          for tok, lp in zip(tokens, logprobs)])

    def _chat_logprobs(self, logprobs: list[TokenLogprob]) -> ChatLogprobs:
        def entry(token_id: int, logprob: float) -> TopLogprob:
            return TopLogprob(token=self._text(token_id), logprob=logprob, bytes=self._bytes(token_id))

        return ChatLogprobs(content=[
            ChatTokenLogprob(**entry(lp.token_id, lp.logprob).model_dump(),
                             top_logprobs=[entry(t, v) for t, v in lp.top])
            for lp in logprobs])


def _tool_call_delta(parser: ToolCallStream, d: Delta) -> tuple[ChatDelta, str | None]:
    """A chat delta with what ``parser`` lets out of ``d``'s text (content, and each call whose
    block closed), and the finish reason a choice that made calls ends with."""
    content, calls = parser.feed(d.text)
    if d.finish_reason is not None:
        content += parser.finish()
    first = parser.num_calls - len(calls)
    chunks = [ToolCallChunk(index=first + k, id=c.id, function=c.function) for k, c in enumerate(calls)]
    return (ChatDelta(content=content or None, tool_calls=chunks or None),
            tool_finish_reason(d.finish_reason, parser.num_calls))


def _include_usage(body: SamplingFields) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


def _json_response(body: BaseModel) -> Response:
    return Response(body.model_dump_json(), media_type="application/json")
