"""OpenEnv's WebSocket session protocol (``WS /ws``): one session per connection, messages
``{"type": "reset" | "step" | "state" | "close", "data": ...}``, answers
``{"type": "observation" | "state", "data": ...}`` or ``{"type": "error", "data": {"code",
"message"}}``. Never raises into the server: a bug is answered ``INTERNAL_ERROR`` and logged
with its traceback, and the session stays open."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

from fastapi import FastAPI, WebSocket
from pydantic import ValidationError
from pydantic_core import from_json
from starlette.types import Message
from starlette.websockets import WebSocketDisconnect, WebSocketState

from deltarl.env_server.core.models import EnvError, ErrorCode, ResetRequest, TextAction
from deltarl.env_server.core.routes import EnvService
from deltarl.env_server.core.sessions import Session
from deltarl.services.common.errors import validation_text

logger = logging.getLogger(__name__)

_WS_EXCLUDE = {"session_id"}  # WS data is exactly OpenEnv's {observation, reward, done}
WS_CLOSE_TIMEOUT = 4408  # app-defined close code: the session timed out


def ws_json(text: str) -> Any:
    """Parse a WS frame with HTTP bodies' parser (pydantic-core's): it raises only ``ValueError``
    (not JSON, a lone surrogate, nested over about 200 levels), never ``RecursionError``
    (``json.loads`` does on ~1000 levels), and nothing nested deep enough to overflow the stack
    reaches the handlers."""
    return from_json(text)


def _frame_text(msg: Message) -> str:
    """Text of a received frame; a binary frame must be UTF-8 (``UnicodeDecodeError`` if not)."""
    text = msg.get("text")
    return text if text is not None else (msg.get("bytes") or b"").decode("utf-8")


async def _ws_close(ws: WebSocket, code: int = 1000, reason: str = "") -> None:
    """Close the socket unless a close was already sent or received. Never raises: a client that
    left meanwhile is no error (Starlette raises ``WebSocketDisconnect``, or with an older
    Starlette uvicorn's ``ClientDisconnected``, an ``OSError``)."""
    connected = WebSocketState.CONNECTED
    if ws.application_state is connected and ws.client_state is connected:
        with contextlib.suppress(WebSocketDisconnect, OSError):
            await ws.close(code=code, reason=reason)


class QuietBadFrames(logging.Filter):
    """uvicorn logs a client's WebSocket text frame that is not UTF-8 with a traceback (its own
    protocol code, before the app sees anything): keep it as one INFO line, so that no client
    can fill the log with tracebacks."""

    MESSAGE = "Invalid UTF-8 sequence received from client"

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage().startswith(self.MESSAGE):
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def quiet_bad_frames() -> None:
    """Install :class:`QuietBadFrames` on uvicorn's error log (once)."""
    uvicorn_error = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, QuietBadFrames) for f in uvicorn_error.filters):
        uvicorn_error.addFilter(QuietBadFrames())


class WsProtocol:
    """The session protocol over one :class:`~.routes.EnvService`."""

    def __init__(self, service: EnvService) -> None:
        self.service = service
        self.closing: set[asyncio.Task[None]] = set()  # close tasks of timed-out sessions

    def error(self, code: ErrorCode, message: str, **extra: Any) -> str:
        self.service.metrics.errors.labels(code.value).inc()
        return json.dumps(
            {"type": "error", "data": {"code": code.value, "message": message, **extra}}
        )

    def handle(self, session: Session, text: str) -> str | None:
        """Answer one WS message; ``None`` means close the connection."""
        service = self.service
        limit = service.settings.max_body_bytes
        if len(text) > limit:
            return self.error(ErrorCode.PAYLOAD_TOO_LARGE, f"message over {limit} bytes")
        try:
            msg = ws_json(text)
        except ValueError as exc:
            return self.error(ErrorCode.INVALID_JSON, f"Invalid JSON: {exc}")
        if not isinstance(msg, dict):
            return self.error(
                ErrorCode.VALIDATION_ERROR, 'expected an object {"type": ..., "data": ...}'
            )
        kind = msg.get("type")
        data = msg.get("data")
        env = session.env
        try:
            if kind == "reset":
                req = ResetRequest.model_validate(data if data is not None else {})
                result = env.reset(
                    seed=req.seed,
                    episode_id=req.episode_id,
                    options=service.reset_options(req.options),
                    policy_version=req.policy_version,
                )
                service.store.started(session)
                service.metrics.reset["ws"].inc()
                return (
                    '{"type":"observation","data":'
                    + result.model_dump_json(exclude=_WS_EXCLUDE)
                    + "}"
                )
            if kind == "step":
                started = time.perf_counter()
                message = service.check_message(TextAction.model_validate(data))
                with session.claim():
                    result = env.step(message)
                service.finish(session, result, "ws")
                body = (
                    '{"type":"observation","data":'
                    + result.model_dump_json(exclude=_WS_EXCLUDE)
                    + "}"
                )
                service.metrics.step_seconds.observe(time.perf_counter() - started)
                return body
            if kind == "state":
                return '{"type":"state","data":' + env.state().model_dump_json() + "}"
            if kind == "close":
                return None
        except ValidationError as exc:
            return self.error(ErrorCode.VALIDATION_ERROR, validation_text(exc.errors()))
        except EnvError as exc:
            return self.error(exc.code, exc.message)
        return self.error(ErrorCode.UNKNOWN_TYPE, f"Unknown message type: {str(kind)[:64]!r}")

    def answer(self, session: Session, msg: Message) -> str | None:
        """Answer one frame; ``None`` means close the connection. Never raises: a bug is answered
        ``INTERNAL_ERROR`` and logged with its traceback (as HTTP answers 500), and the session
        stays open."""
        try:
            text = _frame_text(msg)
        except UnicodeDecodeError:
            return self.error(ErrorCode.INVALID_JSON, "binary frame not UTF-8")
        try:
            return self.handle(session, text)
        except Exception as exc:
            logger.exception("unhandled error in a WS message", exc_info=exc)
            return self.error(ErrorCode.INTERNAL_ERROR, f"internal error: {type(exc).__name__}")

    async def serve(self, ws: WebSocket, session: Session) -> None:
        """Answer frames until the client closes or leaves, sends ``close``, or the reaper closes
        the socket. Raises ``WebSocketDisconnect`` (or ``OSError``) if the client leaves while
        an answer is being sent."""
        while True:
            msg = await ws.receive()
            if msg["type"] == "websocket.disconnect":
                return
            self.service.store.touch(session)
            reply = self.answer(session, msg)
            if reply is None or ws.application_state is not WebSocketState.CONNECTED:
                return  # "close", or the session timed out and the reaper closed the socket
            await ws.send_text(reply)

    async def session(self, ws: WebSocket) -> None:
        """Open the socket's session (or refuse: ``CAPACITY_REACHED``, close code 1013), serve
        it, and free it however the connection ends."""
        store = self.service.store
        try:
            session = store.open("ws", on_expire=lambda: self.close_later(ws))
        except EnvError as exc:
            extra = {"active_sessions": len(store), "max_sessions": store.max_sessions}
            await ws.send_text(self.error(exc.code, exc.message, **extra))
            await _ws_close(ws, code=1013, reason="capacity reached")
            return
        try:
            await self.serve(ws, session)
        finally:
            store.close(session.id, "ws")

    def close_later(self, ws: WebSocket) -> None:
        task = asyncio.get_running_loop().create_task(
            _ws_close(ws, code=WS_CLOSE_TIMEOUT, reason="session timed out")
        )
        self.closing.add(task)
        task.add_done_callback(self.closing.discard)


def add_ws_route(app: FastAPI, service: EnvService) -> None:
    """``WS /ws``: the session protocol."""
    protocol = WsProtocol(service)

    @app.websocket("/ws")
    async def ws_endpoint(ws: WebSocket) -> None:
        """OpenEnv session protocol: reset/step/state/close messages, one session per socket.
        A client that leaves, with or without a close frame, idle or mid-answer, is no error:
        its session is freed and nothing is logged (no traceback)."""
        await ws.accept()
        try:
            await protocol.session(ws)
        except (WebSocketDisconnect, OSError):
            return  # the client left while we were answering (OSError: older Starlette)
        await _ws_close(ws)
