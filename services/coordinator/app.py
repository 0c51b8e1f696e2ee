"""The coordinator's FastAPI application: ``create_app(settings)``.

Lifecycle: the store opens in ``create_app`` (so a wrong URL fails at start), the version index
is loaded from it, and on startup two background tasks begin (their periods: ``Pacing``): one
refreshes the version index every ``event_poll_s`` (versions recorded by other coordinator
processes) and feeds the event stream; one returns expired leases to the queue every
``reclaim_interval_s`` (leasing does it
too, so this only keeps the queue depth honest). On shutdown the streams end and the store closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from deltarl import __version__
from deltarl.services.coordinator.auth import unauthenticated_roles
from deltarl.services.coordinator.errors import ApiError
from deltarl.services.coordinator.events import VersionEvents
from deltarl.services.coordinator.metrics import CoordinatorMetrics
from deltarl.services.coordinator.middleware import BodyLimitMiddleware, MetricsMiddleware
from deltarl.services.coordinator.routers import (
    batches,
    dead_letters,
    health,
    status,
    trajectories,
    versions,
    workers,
)
from deltarl.services.coordinator.service import Coordinator, Pacing
from deltarl.services.coordinator.settings import CoordinatorSettings
from deltarl.services.coordinator.store import CoordinatorStore, open_store

logger = logging.getLogger(__name__)
STATIC = Path(__file__).parent / "static"


def _error(
    status: int,
    code: str,
    message: str,
    detail: object = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(
        {"error": {"code": code, "message": message, "detail": detail}},
        status_code=status,
        headers=headers,
    )


def _allowed_methods(routes: list[APIRoute], path: str) -> list[str]:
    """Methods the API routes accept at ``path``; empty when no route has this path (the status
    page's static files, mounted at /, then answer for it)."""
    return sorted({m for r in routes if r.path_regex.match(path) for m in r.methods or ()})


def _http_error(
    routes: list[APIRoute], request: Request, exc: StarletteHTTPException
) -> JSONResponse:
    """The error body for Starlette's and FastAPI's own refusals.

    * 404/405: 405 with ``Allow`` when an API route has this path but not this method (the
      static mount at / would otherwise answer 404 or a 405 allowing GET only);
    * 400 from FastAPI's body parsing when the JSON decoder failed with something other than
      JSONDecodeError (bytes that are not UTF-8, an integer of more than 4300 digits, nesting
      deeper than the recursion limit): malformed JSON, so 422 ``validation_error``;
    * 413 from BodyLimitMiddleware (a streamed body past the limit): ``body_too_large``.
    """
    allowed = _allowed_methods(routes, request.url.path) if exc.status_code in (404, 405) else []
    if allowed and request.method not in allowed:
        message = f"{request.method} is not allowed here; use {', '.join(allowed)}"
        return _error(405, "method_not_allowed", message, headers={"Allow": ", ".join(allowed)})
    if exc.status_code == 400 and isinstance(exc.__cause__, ValueError | RecursionError):
        cause = str(exc.__cause__)
        detail = [{"loc": ["body"], "msg": cause, "type": "json_invalid"}]
        return _error(422, "validation_error", f"request body is not valid JSON: {cause}", detail)
    code = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}
    return _error(
        exc.status_code,
        code.get(exc.status_code, "http_error"),
        str(exc.detail),
        headers=exc.headers,
    )


def _validation_message(exc: RequestValidationError) -> tuple[str, list[dict[str, object]]]:
    errors = [
        {"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")), "type": e.get("type")}
        for e in exc.errors()
    ]
    first = errors[0] if errors else {"loc": [], "msg": "invalid request"}
    where = ".".join(str(p) for p in first["loc"])
    if any(e["type"] == "json_invalid" for e in errors):
        return "request body is not valid JSON", errors
    return f"invalid request: {where}: {first['msg']}", errors


async def _background(coordinator: Coordinator, events: VersionEvents) -> None:
    pacing = coordinator.pacing
    next_reclaim = 0.0
    loop = asyncio.get_running_loop()
    while True:
        try:
            for record in await coordinator.run(coordinator.versions.refresh):
                events.publish(record)
            if loop.time() >= next_reclaim:
                next_reclaim = loop.time() + pacing.reclaim_interval_s
                n = await coordinator.run(coordinator.store.reclaim_expired, coordinator.clock())
                if n:
                    logger.info("returned %d groups of expired leases to the queue", n)
        except Exception:  # the store may be briefly unreachable: log, keep serving
            logger.exception("background refresh failed")
        await asyncio.sleep(pacing.event_poll_s)


def create_app(
    settings: CoordinatorSettings,
    store: CoordinatorStore | None = None,
    clock: Callable[[], float] | None = None,
    pacing: Pacing | None = None,
) -> FastAPI:
    """The coordinator's app on ``store`` (default: the one ``settings`` name). ``clock``
    (leases, heartbeats) and ``pacing`` (:class:`Pacing`) are for tests."""
    store = store if store is not None else open_store(settings)
    coordinator = Coordinator(store, settings, clock or time.time, pacing)
    metrics = CoordinatorMetrics(coordinator.status)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        events = VersionEvents(asyncio.get_running_loop(), coordinator.versions)
        app.state.events = events

        def on_version(record: object) -> None:
            metrics.version_bytes.labels(record.kind).observe(record.bytes)  # type: ignore[attr-defined]
            events.publish(record)  # type: ignore[arg-type]

        coordinator.on_version = on_version
        task = asyncio.create_task(_background(coordinator, events))
        for line in unauthenticated_roles(settings):
            logger.warning("insecure mode: %s", line)
        try:
            yield
        finally:
            task.cancel()
            events.close()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            coordinator.on_version = None
            store.close()

    app = FastAPI(
        title="deltarl coordinator",
        version=__version__,
        description="Versions, anchors, staleness, workers and the trajectory queue.",
        lifespan=lifespan,
    )
    app.state.coordinator = coordinator
    app.state.metrics = metrics

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return _error(exc.status, exc.code, exc.message, exc.detail)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, errors = _validation_message(exc)
        return _error(422, "validation_error", message, errors)

    routers = [
        m.router for m in (health, versions, workers, trajectories, batches, dead_letters, status)
    ]
    api_routes = [r for router in routers for r in router.routes if isinstance(r, APIRoute)]

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _http_error(api_routes, request, exc)

    for router in routers:
        app.include_router(router)
    app.mount("/", StaticFiles(directory=STATIC, html=True), name="page")
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=settings.max_body_bytes,
        max_json_bytes=settings.max_json_bytes,
    )
    return app


def app_from_env() -> FastAPI:
    """Factory for ``uvicorn --factory`` worker processes: settings from the environment."""
    return create_app(CoordinatorSettings())
