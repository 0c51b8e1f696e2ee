"""ASGI middleware: request body size limits and per-route latency metrics."""

from __future__ import annotations

import json
import time
from typing import Any

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deltarl.services.coordinator.metrics import CoordinatorMetrics


async def _send_error(send: Send, status: int, code: str, message: str) -> None:
    body = json.dumps({"error": {"code": code, "message": message, "detail": None}}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


BINARY_MEDIA_TYPES = frozenset({"application/msgpack"})  # trajectory groups (routers.common)


def _binary(scope: Scope) -> bool:
    """Whether the body is a binary payload (the larger limit): every ``Content-Type`` header
    names a binary media type. Anything else may be parsed as JSON (FastAPI reads any
    ``application/*+json`` as JSON, and a repeated header is read as its first copy), so it gets
    the JSON limit."""
    types = [
        value.decode("latin-1").split(";", 1)[0].strip().lower()
        for name, value in scope["headers"]
        if name.lower() == b"content-type"
    ]
    return bool(types) and all(t in BINARY_MEDIA_TYPES for t in types)


class BodyTooLarge(HTTPException):
    """Raised while a route reads a streamed body past the limit: an HTTPException, so that
    FastAPI's body parsing passes it on (it turns other errors into 400) and the app's handler
    answers 413 ``body_too_large``."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body exceeds {limit} bytes")


class BodyLimitMiddleware:
    """Refuse bodies over ``max_bytes`` (trajectory groups, msgpack) or ``max_json_bytes``
    (everything else) with 413, before any route reads them: checked against
    ``Content-Length`` and again while streaming (chunked bodies, :class:`BodyTooLarge`)."""

    def __init__(self, app: ASGIApp, max_bytes: int, max_json_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_json_bytes = max_json_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        limit = self.max_bytes if _binary(scope) else self.max_json_bytes
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _send_error(
                send,
                413,
                "body_too_large",
                f"request body of {int(declared)} bytes exceeds {limit}",
            )
            return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, limited_receive, send)


class MetricsMiddleware:
    """Observe each request's latency under its route template (not the raw path)."""

    def __init__(self, app: ASGIApp, metrics: CoordinatorMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status: dict[str, Any] = {"code": 500}

        async def capture(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                route = scope.get("route")
                path = getattr(route, "path", None) or "unmatched"
                if not path.endswith("/events"):  # streams last forever: not a latency
                    self.metrics.request_seconds.labels(
                        scope["method"], path, str(status["code"])
                    ).observe(time.perf_counter() - start)
            await send(message)

        await self.app(scope, receive, capture)
