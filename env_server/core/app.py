"""FastAPI app of the environment server: OpenEnv routes, stateful HTTP sessions, WS.

Generic over the task (``DELTARL_ENV_TASK``: one of the task folders that
:mod:`~deltarl.env_server.tasks` finds): every session holds a fresh environment of the task, and the routes only call its
reset/step/state. The pieces: :mod:`.routes` (the info and HTTP session routes over one
:class:`~.routes.EnvService`), :mod:`.ws` (the WebSocket protocol), :mod:`.http` (request
parsing and the error handlers), :mod:`.sessions` (the session store and its reaper).

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
from collections.abc import AsyncIterator

from fastapi import FastAPI

from deltarl import __version__
from deltarl.env_server.core.http import install_error_handlers
from deltarl.env_server.core.metrics import EnvMetrics
from deltarl.env_server.core.routes import EnvService, add_info_routes, add_session_routes
from deltarl.env_server.core.sessions import SessionStore
from deltarl.env_server.core.ws import add_ws_route, quiet_bad_frames
from deltarl.env_server.settings import EnvSettings
from deltarl.env_server.tasks import make_task
from deltarl.services.common.guard import GuardMiddleware


def create_app(settings: EnvSettings | None = None) -> FastAPI:
    """Build the app of the task ``settings.task`` names; ``settings`` default to the
    ``DELTARL_ENV_*`` environment variables."""
    settings = settings if settings is not None else EnvSettings()
    quiet_bad_frames()
    task, spec = make_task(settings)
    store = SessionStore(
        spec.factory,
        max_sessions=settings.max_sessions,
        timeout_s=settings.session_timeout_s,
    )
    metrics = EnvMetrics(store)
    service = EnvService(settings=settings, task=task, spec=spec, store=store, metrics=metrics)

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
    install_error_handlers(app, lambda code: metrics.errors.labels(code).inc())
    add_info_routes(app, service)
    add_session_routes(app, service)
    add_ws_route(app, service)
    return app
