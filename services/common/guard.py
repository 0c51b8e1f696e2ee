"""ASGI middleware in front of every route of the env server and the teacher: the token check and
the body-size limit.

It runs before FastAPI reads a body, so an oversized or unauthenticated request costs no parsing:

* token (when configured): header ``X-Deltarl-Token`` compared in constant time
  (:func:`hmac.compare_digest`); ``/health`` is exempt. HTTP gets 401 ``UNAUTHORIZED``; a
  WebSocket handshake is refused (the client sees HTTP 403) before a session is opened.
* body size: a ``Content-Length`` above ``max_body_bytes`` is refused with 413
  ``PAYLOAD_TOO_LARGE`` at once; a chunked body is counted while it streams in.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from deltarl.services.common.client_headers import TOKEN_HEADER

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_TOKEN_KEY = TOKEN_HEADER.lower().encode("latin-1")
_OPEN_PATHS = frozenset({"/health"})
# the error codes this middleware answers with, and their HTTP status; the body is the services'
# error shape, {"code": ..., "detail": ...}
UNAUTHORIZED = "UNAUTHORIZED"
PAYLOAD_TOO_LARGE = "PAYLOAD_TOO_LARGE"
_STATUS = {UNAUTHORIZED: 401, PAYLOAD_TOO_LARGE: 413}


class GuardMiddleware:
    """See the module docstring. ``on_error`` is told each error code it answers with
    (:data:`UNAUTHORIZED`, :data:`PAYLOAD_TOO_LARGE`)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        token: str | None,
        max_body_bytes: int,
        on_error: Callable[[str], None] | None = None,
    ) -> None:
        self.app = app
        self.token = token.encode("utf-8") if token is not None else None
        self.max_body_bytes = max_body_bytes
        self.on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        if (
            self.token is not None
            and scope["path"] not in _OPEN_PATHS
            and not self._authorized(scope)
        ):
            if kind == "websocket":
                self._count(UNAUTHORIZED)
                await send({"type": "websocket.close", "code": 1008, "reason": "unauthorized"})
            else:
                await self._reject(send, UNAUTHORIZED, f"missing or wrong {TOKEN_HEADER} header")
            return
        if kind == "websocket":
            await self.app(scope, receive, send)
            return
        length = self._content_length(scope)
        if length is not None and length > self.max_body_bytes:
            await self._reject(send, PAYLOAD_TOO_LARGE, self._too_large(length))
            return
        await self._call_counting(scope, receive, send)

    async def _call_counting(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Count a streamed body; past the limit, answer 413 ourselves, tell the app that the
        client left (``http.disconnect``) and drop whatever the app still tries to send."""
        received = 0
        started = False
        rejected = False

        async def counting_receive() -> Message:
            nonlocal received, rejected
            if rejected:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes and not started:
                    rejected = True
                    await self._reject(send, PAYLOAD_TOO_LARGE, self._too_large(received))
                    return {"type": "http.disconnect"}
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if rejected:
                return
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        await self.app(scope, counting_receive, tracking_send)

    def _authorized(self, scope: Scope) -> bool:
        assert self.token is not None
        for key, value in scope.get("headers", ()):
            if key == _TOKEN_KEY:
                return hmac.compare_digest(value, self.token)
        return False

    @staticmethod
    def _content_length(scope: Scope) -> int | None:
        for key, value in scope.get("headers", ()):
            if key == b"content-length":
                try:
                    return int(value)
                except ValueError:
                    return None
        return None

    def _too_large(self, size: int) -> str:
        return f"the body has at least {size} bytes; the limit is {self.max_body_bytes}"

    def _count(self, code: str) -> None:
        if self.on_error is not None:
            self.on_error(code)

    async def _reject(self, send: Send, code: str, detail: str) -> None:
        self._count(code)
        status = _STATUS[code]
        body = json.dumps({"code": code, "detail": detail}, separators=(",", ":")).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
