"""FastAPI app of the environment server: OpenEnv routes, stateful HTTP sessions, WS.

Generic over the task (``DELTARL_ENV_TASK``: Wordle or charset, see :mod:`.tasks`): every session
holds a fresh environment of the task, and the routes only call its reset/step/state.

Routes (see docs/env_server.md for the protocol and the errors table):

* ``POST /reset`` opens a session (or resets ``session_id``) and returns its first observation
  with ``session_id``; ``POST /step``, ``GET /state`` and ``POST /close`` take that id.
* ``WS /ws``: OpenEnv's session protocol, one session per connection.
* ``GET /health`` (no token), ``/metadata``, ``/schema``, ``/metrics`` (Prometheus).

Every failure is answered with an :class:`~.models.ErrorCode`: HTTP as ``{"code", "detail"}``
with the status of ``HTTP_STATUS``, WS as ``{"type": "error", "data": {"code", "message"}}``.
Handlers never await while they hold a session, so a step is atomic.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any, TypeVar

from fastapi import FastAPI, Query, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError
from pydantic_core import from_json
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Message
from starlette.websockets import WebSocketDisconnect, WebSocketState

from deltarl import __version__
from deltarl.env_server.core.metrics import EnvMetrics
from deltarl.env_server.core.models import (
    HTTP_STATUS,
    SESSION_HEADER,
    CloseRequest,
    CloseResponse,
    EnvError,
    EnvMetadata,
    ErrorCode,
    ErrorResponse,
    HealthResponse,
    ResetRequest,
    SchemaResponse,
    StateResponse,
    StepRequest,
    StepResult,
    WordleAction,
)
from deltarl.env_server.core.sessions import Session, SessionStore
from deltarl.env_server.settings import EnvSettings
from deltarl.env_server.tasks import make_task
from deltarl.env_server.wordle.game import WordLists
from deltarl.services.common.guard import GuardMiddleware

logger = logging.getLogger(__name__)

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 409, 413, 422, 503)
}
_HTTP_CODES = {
    400: ErrorCode.INVALID_JSON,  # FastAPI: "There was an error parsing the body"
    404: ErrorCode.NOT_FOUND,
    405: ErrorCode.METHOD_NOT_ALLOWED,
    413: ErrorCode.PAYLOAD_TOO_LARGE,
}
_WS_EXCLUDE = {"session_id"}  # WS data is exactly OpenEnv's {observation, reward, done}
WS_CLOSE_TIMEOUT = 4408  # app-defined close code: the session timed out
_SESSION_KEY = SESSION_HEADER.lower()
M = TypeVar("M", bound=BaseModel)


def _body_doc(model: type[BaseModel]) -> dict[str, Any]:
    """OpenAPI request body of a route that parses its body itself (see :func:`_parse`)."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"content": {"application/json": {"schema": ref}}}}


def _parse(model: type[M], body: bytes, default: bool = False) -> M:
    """Validate a JSON body straight from bytes (pydantic-core's parser, no FastAPI body
    machinery: about half the cost of a step). Empty body: the model's defaults if ``default``."""
    if not body and default:
        return model()
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        errors = exc.errors(include_input=False)
        if any(e["type"] == "json_invalid" for e in errors):
            raise EnvError(ErrorCode.INVALID_JSON, "the body is not valid JSON (UTF-8)") from None
        raise EnvError(ErrorCode.VALIDATION_ERROR, _validation_text(errors)) from None


async def _body(request: Request) -> bytes:
    try:
        return await request.body()
    except ClientDisconnect:  # the client left, or the guard cut an oversized body and answered
        raise EnvError(ErrorCode.INVALID_JSON, "the body was not received completely") from None


def _session_header(request: Request) -> str | None:
    value = request.headers.get(_SESSION_KEY)
    return value[:64] if value else None


def _validation_text(errors: list[Any], limit: int = 5) -> str:
    """``loc: msg`` of the first errors, never the (possibly huge) input itself."""
    parts = []
    for err in errors[:limit]:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        parts.append(f"{loc}: {err.get('msg', 'invalid')}")
    more = f" (+{len(errors) - limit} more)" if len(errors) > limit else ""
    return "; ".join(parts) + more


def _ws_json(text: str) -> Any:
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


def _quiet_bad_frames() -> None:
    uvicorn_error = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, QuietBadFrames) for f in uvicorn_error.filters):
        uvicorn_error.addFilter(QuietBadFrames())


def create_app(settings: EnvSettings | None = None, words: WordLists | None = None) -> FastAPI:
    """Build the app; ``settings`` default to the ``DELTARL_ENV_*`` environment variables,
    ``words`` (Wordle's lists) to the shipped ones."""
    settings = settings if settings is not None else EnvSettings()
    _quiet_bad_frames()
    task = make_task(settings, words)
    store = SessionStore(
        task.factory,
        max_sessions=settings.max_sessions,
        timeout_s=settings.session_timeout_s,
    )
    metrics = EnvMetrics(store)
    max_chars = settings.max_message_chars
    closing: set[asyncio.Task[None]] = set()

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        reaper = asyncio.create_task(store.run_reaper())
        try:
            yield
        finally:
            reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reaper

    app = FastAPI(
        title=f"deltarl {task.name} environment",
        version=__version__,
        description=f"OpenEnv-compatible {task.name} server with stateful HTTP sessions.",
        lifespan=lifespan,
        strict_content_type=False,  # a JSON body without Content-Type is still JSON
    )
    app.state.settings = settings
    app.state.store = store
    app.state.metrics = metrics
    token = settings.token.get_secret_value() if settings.token is not None else None
    app.add_middleware(
        GuardMiddleware,
        token=token,
        max_body_bytes=settings.max_body_bytes,
        on_error=lambda code: metrics.errors.labels(code).inc(),
    )

    def error_response(code: ErrorCode, detail: str) -> Response:
        metrics.errors.labels(code.value).inc()
        body = ErrorResponse(code=code, detail=detail).model_dump_json().encode("utf-8")
        return Response(body, status_code=HTTP_STATUS[code], media_type="application/json")

    @app.exception_handler(EnvError)
    async def _env_error(_: Request, exc: EnvError) -> Response:
        return error_response(exc.code, exc.message)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> Response:
        errors = list(exc.errors())
        if any(e.get("type") == "json_invalid" for e in errors):
            return error_response(ErrorCode.INVALID_JSON, "the body is not valid JSON")
        return error_response(ErrorCode.VALIDATION_ERROR, _validation_text(errors))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> Response:
        code = _HTTP_CODES.get(exc.status_code, ErrorCode.INTERNAL_ERROR)
        return error_response(code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception) -> Response:
        logger.exception("unhandled error", exc_info=exc)
        return error_response(ErrorCode.INTERNAL_ERROR, f"internal error: {type(exc).__name__}")

    def check_message(action: WordleAction) -> str:
        if len(action.message) > max_chars:
            raise EnvError(
                ErrorCode.PAYLOAD_TOO_LARGE,
                f"action.message has {len(action.message)} characters; the limit is {max_chars}",
            )
        return action.message

    def finish(session: Session, result: StepResult, transport: str) -> None:
        if result.done:
            outcome = session.env.outcome
            assert outcome is not None
            metrics.game_over(outcome)
            session.playing = False
        metrics.step[transport].inc()

    # --- OpenEnv info routes ------------------------------------------------------------------

    @app.get("/health", response_model=HealthResponse, tags=["info"])
    async def health() -> HealthResponse:
        """Liveness: ``{"status": "healthy"}`` (never needs the token)."""
        return HealthResponse()

    @app.get("/metadata", response_model=EnvMetadata, tags=["info"])
    async def metadata() -> EnvMetadata:
        """OpenEnv ``EnvironmentMetadata``."""
        return EnvMetadata(
            name=task.name,
            description=task.description,
            version=__version__,
            author="deltarl",
            documentation_url="docs/env_server.md",
            system_prompt=task.system_prompt,
            max_turns=task.max_turns,
        )

    @app.get("/schema", response_model=SchemaResponse, tags=["info"])
    async def schema() -> SchemaResponse:
        """JSON schemas of the action, the observation and the state."""
        return SchemaResponse(
            action=WordleAction.model_json_schema(),
            observation=task.observation.model_json_schema(),
            state=task.state.model_json_schema(),
        )

    @app.get("/metrics", tags=["info"], response_class=Response)
    async def prometheus() -> Response:
        """Prometheus text format."""
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    # --- HTTP sessions ------------------------------------------------------------------------

    @app.post(
        "/reset",
        response_model=StepResult,
        responses=ERROR_RESPONSES,
        tags=["env"],
        openapi_extra=_body_doc(ResetRequest),
    )
    async def reset(request: Request) -> Response:
        """Open a session (or reset ``session_id``) and return the first observation."""
        req = _parse(ResetRequest, await _body(request), default=True)
        session = store.get(req.session_id) if req.session_id else store.open("http")
        with session.claim():
            try:
                result = session.env.reset(
                    seed=req.seed, episode_id=req.episode_id, options=req.options
                )
            except EnvError:
                if not req.session_id:  # refused options: no half-opened session is left
                    store.close(session.id, "http")
                raise
            session.last_request_id = session.last_response = None
        store.started(session)
        store.touch(session)
        result.session_id = session.id
        metrics.reset["http"].inc()
        return Response(result.model_dump_json(), media_type="application/json")

    @app.post(
        "/step",
        response_model=StepResult,
        responses=ERROR_RESPONSES,
        tags=["env"],
        openapi_extra=_body_doc(StepRequest),
    )
    async def step(request: Request) -> Response:
        """Play ``action.message`` in the session; replays the cached answer for a repeated
        ``request_id``."""
        started = time.perf_counter()
        req = _parse(StepRequest, await _body(request))
        session = store.get(req.session_id or _session_header(request))
        message = check_message(req.action)
        with session.claim():
            if req.request_id is not None and req.request_id == session.last_request_id:
                assert session.last_response is not None
                body = session.last_response
            else:
                result = session.env.step(message)
                result.session_id = session.id
                body = result.model_dump_json()
                finish(session, result, "http")
                session.last_request_id = req.request_id
                session.last_response = body if req.request_id is not None else None
        store.touch(session)
        metrics.step_seconds.observe(time.perf_counter() - started)
        return Response(body, media_type="application/json")

    @app.get("/state", response_model=StateResponse, responses=ERROR_RESPONSES, tags=["env"])
    async def state(
        request: Request, session_id: Annotated[str | None, Query(max_length=64)] = None
    ) -> Response:
        """State of the session; without a session id, the empty state (as OpenEnv's stateless
        server answers)."""
        sid = session_id or _session_header(request)
        if not sid:
            fresh = task.empty_state()
            return Response(fresh.model_dump_json(), media_type="application/json")
        session = store.get(sid)
        store.touch(session)
        return Response(session.env.state().model_dump_json(), media_type="application/json")

    @app.post(
        "/close",
        response_model=CloseResponse,
        responses=ERROR_RESPONSES,
        tags=["env"],
        openapi_extra=_body_doc(CloseRequest),
    )
    async def close(request: Request) -> CloseResponse:
        """Free the session now. Idempotent: closing an unknown session answers ``closed: false``."""
        req = _parse(CloseRequest, await _body(request), default=True)
        sid = req.session_id or _session_header(request)
        if not sid:
            raise EnvError(ErrorCode.SESSION_REQUIRED, "pass the session_id to close")
        return CloseResponse(closed=store.close(sid, "http"))

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = spec.setdefault("components", {}).setdefault("schemas", {})
            for model in (ResetRequest, StepRequest, CloseRequest):
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    # --- WebSocket sessions (OpenEnv) ----------------------------------------------------------

    def ws_error(code: ErrorCode, message: str, **extra: Any) -> str:
        metrics.errors.labels(code.value).inc()
        return json.dumps(
            {"type": "error", "data": {"code": code.value, "message": message, **extra}}
        )

    def ws_handle(session: Session, text: str) -> str | None:
        """Answer one WS message; ``None`` means close the connection."""
        if len(text) > settings.max_body_bytes:
            return ws_error(
                ErrorCode.PAYLOAD_TOO_LARGE, f"message over {settings.max_body_bytes} bytes"
            )
        try:
            msg = _ws_json(text)
        except ValueError as exc:
            return ws_error(ErrorCode.INVALID_JSON, f"Invalid JSON: {exc}")
        if not isinstance(msg, dict):
            return ws_error(
                ErrorCode.VALIDATION_ERROR, 'expected an object {"type": ..., "data": ...}'
            )
        kind = msg.get("type")
        data = msg.get("data")
        env = session.env
        try:
            if kind == "reset":
                req = ResetRequest.model_validate(data if data is not None else {})
                result = env.reset(seed=req.seed, episode_id=req.episode_id, options=req.options)
                store.started(session)
                metrics.reset["ws"].inc()
                return (
                    '{"type":"observation","data":'
                    + result.model_dump_json(exclude=_WS_EXCLUDE)
                    + "}"
                )
            if kind == "step":
                started = time.perf_counter()
                message = check_message(WordleAction.model_validate(data))
                with session.claim():
                    result = env.step(message)
                finish(session, result, "ws")
                body = (
                    '{"type":"observation","data":'
                    + result.model_dump_json(exclude=_WS_EXCLUDE)
                    + "}"
                )
                metrics.step_seconds.observe(time.perf_counter() - started)
                return body
            if kind == "state":
                return '{"type":"state","data":' + env.state().model_dump_json() + "}"
            if kind == "close":
                return None
        except ValidationError as exc:
            return ws_error(ErrorCode.VALIDATION_ERROR, _validation_text(exc.errors()))
        except EnvError as exc:
            return ws_error(exc.code, exc.message)
        return ws_error(ErrorCode.UNKNOWN_TYPE, f"Unknown message type: {str(kind)[:64]!r}")

    def ws_answer(session: Session, msg: Message) -> str | None:
        """Answer one frame; ``None`` means close the connection. Never raises: a bug is answered
        ``INTERNAL_ERROR`` and logged with its traceback (as HTTP answers 500), and the session
        stays open."""
        try:
            text = _frame_text(msg)
        except UnicodeDecodeError:
            return ws_error(ErrorCode.INVALID_JSON, "binary frame not UTF-8")
        try:
            return ws_handle(session, text)
        except Exception as exc:
            logger.exception("unhandled error in a WS message", exc_info=exc)
            return ws_error(ErrorCode.INTERNAL_ERROR, f"internal error: {type(exc).__name__}")

    async def ws_serve(ws: WebSocket, session: Session) -> None:
        """Answer frames until the client closes or leaves, sends ``close``, or the reaper closes
        the socket. Raises ``WebSocketDisconnect`` (or ``OSError``) if the client leaves while
        an answer is being sent."""
        while True:
            msg = await ws.receive()
            if msg["type"] == "websocket.disconnect":
                return
            store.touch(session)
            reply = ws_answer(session, msg)
            if reply is None or ws.application_state is not WebSocketState.CONNECTED:
                return  # "close", or the session timed out and the reaper closed the socket
            await ws.send_text(reply)

    async def ws_session(ws: WebSocket) -> None:
        """Open the socket's session (or refuse: ``CAPACITY_REACHED``, close code 1013), serve
        it, and free it however the connection ends."""
        try:
            session = store.open("ws", on_expire=lambda: close_later(ws))
        except EnvError as exc:
            extra = {"active_sessions": len(store), "max_sessions": store.max_sessions}
            await ws.send_text(ws_error(exc.code, exc.message, **extra))
            await _ws_close(ws, code=1013, reason="capacity reached")
            return
        try:
            await ws_serve(ws, session)
        finally:
            store.close(session.id, "ws")

    def close_later(ws: WebSocket) -> None:
        task = asyncio.get_running_loop().create_task(
            _ws_close(ws, code=WS_CLOSE_TIMEOUT, reason="session timed out")
        )
        closing.add(task)
        task.add_done_callback(closing.discard)

    @app.websocket("/ws")
    async def ws_endpoint(ws: WebSocket) -> None:
        """OpenEnv session protocol: reset/step/state/close messages, one session per socket.
        A client that leaves, with or without a close frame, idle or mid-answer, is no error:
        its session is freed and nothing is logged (no traceback)."""
        await ws.accept()
        try:
            await ws_session(ws)
        except (WebSocketDisconnect, OSError):
            return  # the client left while we were answering (OSError: older Starlette)
        await _ws_close(ws)

    return app
