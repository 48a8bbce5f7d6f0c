"""ASGI middleware of the server: the optional API key, the request-body limit, and response counts."""

from __future__ import annotations

import hmac

from fastapi import HTTPException
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specflow.serve.metrics import Metrics
from specflow.serve.responses import error_body

ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions")


class ApiKeyAuth:
    """Answers 401 to ``/v1/*`` requests without ``Authorization: Bearer <key>``; ``/health`` and
    ``/metrics`` stay open to probes and scrapers."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            # (the scheme's case does not matter, RFC 9110; the key's does)
            scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            if not (hmac.compare_digest(given, self.key) and scheme.lower() == b"bearer"):
                body = error_body("Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                                  code="invalid_api_key")
                await JSONResponse(body, 401, {"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


class LimitBody:
    """Answers 413 to a request whose body is larger than ``max_bytes``: before reading any of it
    when its Content-Length says so, else as soon as the bytes read pass the limit (a chunked body)."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = int(dict(scope["headers"]).get(b"content-length", 0))
        read = 0

        async def receive_within_limit() -> Message:
            nonlocal read
            if declared > self.max_bytes:
                raise self._too_large()
            message = await receive()
            read += len(message.get("body", b""))
            if read > self.max_bytes:
                raise self._too_large()
            return message

        await self.app(scope, receive_within_limit, send)

    def _too_large(self) -> HTTPException:
        # FastAPI passes an HTTPException raised while it reads the body on to _http_error
        return HTTPException(413, f"the request body is larger than this server's limit of {self.max_bytes} "
                                  "bytes (limits.max_request_bytes)")


class CountResponses:
    """Counts ``/v1/*`` responses by endpoint and status code into ``specflow_requests_total``."""

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"
            self.metrics.requests.labels(endpoint, str(status)).inc()
