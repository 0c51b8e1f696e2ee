"""The coordinator's FastAPI application: ``create_app(settings)``.

Lifecycle: the store opens in ``create_app`` (so a wrong URL fails at start), the version index
is loaded from it, and on startup two background tasks begin: one refreshes the version index
every ``event_poll_s`` (versions recorded by other coordinator processes) and feeds the event
stream; one returns expired leases to the queue every ``reclaim_interval_s`` (leasing does it
too, so this only keeps the queue depth honest). On shutdown the streams end and the store closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from deltarl import __version__

from .errors import ApiError
from .events import VersionEvents
from .metrics import CoordinatorMetrics
from .middleware import BodyLimitMiddleware, MetricsMiddleware
from .routers import batches, health, plans, status, trajectories, versions, workers
from .service import Coordinator
from .settings import CoordinatorSettings
from .store import CoordinatorStore, open_store

logger = logging.getLogger(__name__)
STATIC = Path(__file__).parent / "static"


def _error(status: int, code: str, message: str, detail: object = None) -> JSONResponse:
    return JSONResponse(
        {"error": {"code": code, "message": message, "detail": detail}}, status_code=status
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
    settings = coordinator.settings
    next_reclaim = 0.0
    loop = asyncio.get_running_loop()
    while True:
        try:
            for record in await coordinator.run(coordinator.versions.refresh):
                events.publish(record)
            if loop.time() >= next_reclaim:
                next_reclaim = loop.time() + settings.reclaim_interval_s
                n = await coordinator.run(coordinator.store.reclaim_expired, coordinator.clock())
                if n:
                    logger.info("returned %d groups of expired leases to the queue", n)
        except Exception:  # the store may be briefly unreachable: log, keep serving
            logger.exception("background refresh failed")
        await asyncio.sleep(settings.event_poll_s)


def create_app(
    settings: CoordinatorSettings,
    store: CoordinatorStore | None = None,
    clock: Callable[[], float] | None = None,
) -> FastAPI:
    store = store if store is not None else open_store(settings)
    coordinator = Coordinator(store, settings, clock) if clock else Coordinator(store, settings)
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
        if not (settings.trainer_token and settings.worker_token):
            logger.warning("coordinator running without trainer/worker tokens (insecure mode)")
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

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return _error(exc.status_code, code, str(exc.detail))

    for module in (health, versions, workers, trajectories, batches, status, plans):
        app.include_router(module.router)
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
