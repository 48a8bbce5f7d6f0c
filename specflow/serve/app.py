"""The FastAPI application: routes, OpenAI-style errors, the optional API key, and the server entry."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import sys
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from specflow.config import ConfigError, load_yaml, validate
from specflow.engine import SpecEngine
from specflow.pipeline import EngineConfig
from specflow.serve.completions import CLIENT_CLOSED, OpenAIServing
from specflow.serve.inputs import ApiError
from specflow.serve.engine_loop import EngineLoop, EngineNotRunning
from specflow.serve.metrics import Metrics
from specflow.serve.middleware import ApiKeyAuth, CountResponses, LimitBody
from specflow.serve.chat_protocol import ChatCompletionRequest
from specflow.serve.protocol import CompletionRequest
from specflow.serve.responses import ModelCard, ModelList, error_body

log = logging.getLogger("specflow.serve")
Body = TypeVar("Body", bound=BaseModel)

class ErrorResponse(JSONResponse):
    """An error body as ASCII JSON: a message that quotes the client's input (a model name, a
    field name) renders even when that input holds a lone UTF-16 surrogate, which is valid JSON
    (``"\\ud800"``) but no UTF-8 text."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


@dataclass
class RequestLimits:
    """What one request may ask of the server: a body larger than ``max_request_bytes`` is a 413,
    and a request puts at most ``max_sequences`` sequences in the engine (one engine request each):
    prompts x ``n`` for ``/v1/completions``, ``n`` for ``/v1/chat/completions``; more is a 400."""

    max_request_bytes: int = 16 * 2**20   # 16 MiB: text of millions of tokens, past any context
    max_sequences: int = 64

    def __post_init__(self) -> None:
        if self.max_request_bytes < 1 or self.max_sequences < 1:
            raise ConfigError(f"max_request_bytes and max_sequences must be >= 1, got {self}")


@dataclass
class ServeConfig:
    """A serve YAML: the model id that clients name (default: the target directory's name), the
    request limits, and the engine behind it (``spec_max_batch_size`` turns speculation off for
    larger batches)."""

    name: str | None = None
    limits: RequestLimits = field(default_factory=RequestLimits)
    engine: EngineConfig = field(default_factory=EngineConfig)


def load_serve_config(path: str | Path, overrides: list[str] | None = None) -> ServeConfig:
    """Read a serve YAML with ``key=value`` overrides; a misspelt key names the valid ones."""
    return validate(ServeConfig, load_yaml(path, overrides), "serve")


NOT_AN_OBJECT = "the request body must be a JSON object (with Content-Type: application/json)"


def decode_body(model: type[Body], raw: bytes, content_type: str | None) -> Body:
    """A request body as ``model``: JSON-decoded and validated, else a 400 naming each bad field
    (or the JSON syntax error). A body without a Content-Type is read as JSON, as FastAPI (vLLM,
    SGLang) reads it: ``requests.post(url, data=json.dumps(body))`` sends none."""
    media_type = (content_type or "").split(";")[0].strip().lower()
    if not raw or not (media_type in ("", "application/json") or
                       media_type.startswith("application/") and media_type.endswith("+json")):
        raise ApiError(400, NOT_AN_OBJECT)
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:   # (also bytes in no UTF, and nesting past the stack)
        reason = str(e)
        if "integer string conversion" in reason:   # (Python's message ends with a hint for the server)
            reason = f"a number has more than {sys.get_int_max_str_digits()} digits"
        raise ApiError(400, f"the request body is not valid JSON: {reason}") from None
    if not isinstance(data, dict):
        raise ApiError(400, NOT_AN_OBJECT)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        fields = [".".join(str(x) for x in error["loc"]) for error in errors]   # "" for a whole-body check
        for error in errors:
            if error["type"] == "extra_forbidden":   # (pydantic says "Extra inputs are not permitted")
                error["msg"] = "not a parameter this server takes (see the README for what it supports)"
            elif error["type"] == "value_error":   # our checks' own words, without pydantic's "Value error, "
                error["msg"] = str(error["ctx"]["error"])
        message = "; ".join(f"{f}: {error['msg']}" if f else error["msg"] for f, error in zip(fields, errors))
        raise ApiError(400, message, param=fields[0] or None) from None


async def read_body(request: Request, model: type[Body]) -> Body:
    """The request body as ``model``, decoded and validated on a worker thread: on the event loop,
    a body of many MB would stall every other request meanwhile (160k chat messages take ~1.5 s)."""
    try:
        raw = await request.body()
    except ClientDisconnect:   # (no one reads the answer: it is for the log and the metrics)
        raise ApiError(CLIENT_CLOSED, "the client closed the connection before sending the whole body") from None
    return await asyncio.to_thread(decode_body, model, raw, request.headers.get("content-type"))


async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return ErrorResponse(error_body(str(exc.detail), kind), exc.status_code, exc.headers)


async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
    return ErrorResponse(exc.body, exc.status)


async def _engine_not_running(_: Request, exc: EngineNotRunning) -> JSONResponse:
    return ErrorResponse(error_body(str(exc), "server_error"), 503)


class GracefulServer(uvicorn.Server):
    """uvicorn, except that requests still running ``grace`` seconds after SIGINT / SIGTERM end
    through the engine (``finish_reason: "abort"``, then ``[DONE]``) instead of having their
    tasks cancelled mid-response."""

    def __init__(self, config: uvicorn.Config, engine_loop: EngineLoop, grace: float):
        super().__init__(config)
        self.engine_loop = engine_loop
        self.grace = grace

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()   # refuse new connections while the ones in flight finish
        # and new requests on the open ones: an idle keep-alive connection closes now, a busy one
        # after its response (uvicorn's own shutdown does this only once the grace is over, and a
        # client's pooled connections would keep sending requests through all of it)
        for connection in list(self.server_state.connections):
            connection.shutdown()
        deadline = time.monotonic() + self.grace
        # (the tasks: requests received but not yet in the engine, being parsed or tokenized)
        while (self.engine_loop.in_flight or self.server_state.tasks) and time.monotonic() < deadline \
                and not self.force_exit:   # (a second Ctrl+C)
            await asyncio.sleep(0.05)
        if self.engine_loop.in_flight:
            log.warning("ending %d requests still running %s s after the signal", self.engine_loop.in_flight,
                        self.grace)
        self.engine_loop.cancel_all()
        await super().shutdown(sockets)


def build_app(engine: SpecEngine, model_name: str, api_key: str | None = None,
              limits: RequestLimits | None = None) -> FastAPI:
    """An OpenAI-compatible app over ``engine``; the engine thread runs for the app's lifespan."""
    if engine.tokenizer is None:
        raise ConfigError("serving needs a tokenizer: the target directory has no tokenizer files")
    limits = limits or RequestLimits()
    num_nodes = engine.tree_builder.num_draft_tokens if engine.drafter is not None else 1
    metrics = Metrics(max_accept_length=num_nodes, num_kv_pages=engine.runner.cache.allocator.num_pages)
    loop = EngineLoop(engine, metrics)
    serving = OpenAIServing(loop, model_name, limits.max_sequences)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        loop.start()
        yield
        await asyncio.to_thread(loop.stop)

    app = FastAPI(title="specflow", lifespan=lifespan)
    app.state.engine_loop = loop
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(EngineNotRunning, _engine_not_running)
    app.add_middleware(LimitBody, max_bytes=limits.max_request_bytes)
    if api_key:
        app.add_middleware(ApiKeyAuth, api_key=api_key)
    app.add_middleware(CountResponses, metrics=metrics)

    @app.get("/health")
    async def health() -> Response:
        ok = loop.alive
        return JSONResponse({"status": "ok" if ok else "stopped"}, 200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    card = ModelCard(id=model_name, created=created, max_model_len=serving.inputs.context_len)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[card])

    @app.get("/v1/models/{model:path}")   # (ids may hold slashes: meta-llama/Llama-3.1-8B)
    async def model(model: str) -> ModelCard:
        serving.inputs.check_model(model)
        return card

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serving.completions(await read_body(request, CompletionRequest), request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await serving.chat(await read_body(request, ChatCompletionRequest), request)

    def openapi() -> dict:
        """FastAPI's schema (``/openapi.json``, ``/docs``) with the request bodies that the
        generation routes read themselves (``read_body``)."""
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, model in (("/v1/completions", CompletionRequest), ("/v1/chat/completions", ChatCompletionRequest)):
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}), **{model.__name__: body})
                schema["paths"][path]["post"]["requestBody"] = {"required": True, "content": {
                    "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    return app


def run_server(config: str | Path, overrides: list[str] | None = None, *, host: str = "127.0.0.1",
               port: int = 8000, api_key: str | None = None, shutdown_timeout: int = 30) -> None:
    """Load the engine of a serve YAML and serve it until SIGINT / SIGTERM.

    On a signal the server stops accepting connections, lets requests in flight finish for up to
    ``shutdown_timeout`` seconds, ends the rest with what they have (``finish_reason: "abort"``),
    and exits with 0.
    """
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")
    cfg = load_serve_config(config, overrides)
    engine = SpecEngine.from_config(cfg.engine)
    name = cfg.name or Path(cfg.engine.target).name
    app = build_app(engine, name, api_key, cfg.limits)
    log.info("serving '%s' (%s) on http://%s:%d", name, engine.pipeline.describe(), host, port)
    # uvicorn's own graceful timeout only bounds the last writes: the engine has ended every request
    config = uvicorn.Config(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)
    server = GracefulServer(config, app.state.engine_loop, shutdown_timeout)
    # uvicorn re-raises the signal it shut down on; after a graceful shutdown that means "exit 0"
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        server.run()
    except KeyboardInterrupt:
        pass
