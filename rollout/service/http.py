"""The rollout worker's HTTP endpoints: ``GET /health`` and ``GET /metrics``.

:class:`WorkerHttpServer` runs uvicorn on the worker's own event loop (a task next to the
episode loop; no extra thread), on ``settings.host``/``settings.port``, with TLS when the
settings name a certificate (:class:`~deltarl.services.common.tls.TLSServerSettings`).

Order of calls (:meth:`RolloutWorker.run_async`)::

    start(): bind the port (the default port when taken: a free one instead, logged;
             an explicitly set port that is taken raises BindError) -> serve task, wait until up
    ... register, sync, episodes: /health says 503 until the first anchor is loaded ...
    stop():  after the worker deregistered, close the port (1 s for open connections)

Both routes are read-only and need no token, like the coordinator's and the env server's
``/health`` (``/metrics``: the coordinator's needs its reader token when its reads are not
public; the env server's needs none). Bind to 127.0.0.1 (the default) to keep them private.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Literal

import uvicorn
from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, Field

import deltarl
from deltarl.rollout.settings import RolloutSettings

if TYPE_CHECKING:
    from deltarl.rollout.service.view import WorkerView

logger = logging.getLogger(__name__)

__all__ = ["BindError", "WorkerHealth", "WorkerHttpServer", "create_app"]


class BindError(OSError):
    """The endpoints' host and port cannot be bound (taken, not this machine's, privileged)."""


class WorkerHealth(BaseModel):
    """Body of ``GET /health`` (status 200 when ``healthy``, else 503)."""

    status: Literal["ok", "starting", "unhealthy", "stopping"] = Field(
        description="'starting': no verified weights yet (before the first anchor); "
        "'unhealthy': generation is refused (see reason); 'stopping': graceful shutdown."
    )
    worker_id: str = Field(description="This worker's id at the coordinator.")
    healthy: bool = Field(description="Generation may run: the weights are verified.")
    reason: str = Field(description="'ok', or why generation is refused.")
    version: int | None = Field(description="Newest verified version (None: none yet).")
    applied_version: int | None = Field(
        description="Version generation runs with (may be a delta pending verification)."
    )
    target_version: int | None = Field(description="Newest version heard of (sync target).")
    in_flight_groups: int = Field(description="Groups being played.")
    last_error: str | None = Field(description="Latest error (a failed sync, submit, ...).")
    uptime_s: float = Field(description="Seconds since the worker was set up.")


def health_of(worker: WorkerView, started: float) -> WorkerHealth:
    """The worker's health now (``started``: its ``time.monotonic()`` at start)."""
    s = worker.sync.status()
    if worker.stopping:
        status: Literal["ok", "starting", "unhealthy", "stopping"] = "stopping"
    elif s.healthy:
        status = "ok"
    else:
        status = "starting" if s.verified_version is None else "unhealthy"
    return WorkerHealth(
        status=status,
        worker_id=worker.worker_id,
        healthy=s.healthy,
        reason=s.reason,
        version=s.verified_version,
        applied_version=s.version,
        target_version=worker.follower.wanted,
        in_flight_groups=worker.in_flight,
        last_error=worker.last_error,
        uptime_s=round(time.monotonic() - started, 3),
    )


def create_app(worker: WorkerView) -> FastAPI:
    """The two routes over ``worker`` (its state and ``worker.metrics``)."""
    app = FastAPI(
        title="deltarl rollout worker",
        version=deltarl.__version__,
        docs_url=None,
        redoc_url=None,
    )
    started = time.monotonic()

    @app.get(
        "/health",
        response_model=WorkerHealth,
        responses={503: {"model": WorkerHealth, "description": "Weights not healthy"}},
    )
    async def health(response: Response) -> WorkerHealth:
        """200 while the weights are verified, else 503; the body says why."""
        body = health_of(worker, started)
        if not body.healthy:
            response.status_code = 503
        return body

    @app.get(
        "/metrics",
        response_class=Response,
        responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text"}},
    )
    async def metrics() -> Response:
        """Prometheus text format (every metric: docs/rollout.md, "HTTP endpoints")."""
        return Response(worker.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


class _EmbeddedServer(uvicorn.Server):
    """uvicorn on a loop it does not own: it leaves SIGTERM/SIGINT to the worker."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class WorkerHttpServer:
    """Serves :func:`create_app` on the running event loop; see the module docstring."""

    def __init__(self, app: FastAPI, settings: RolloutSettings) -> None:
        self.app = app
        self.settings = settings
        self._server: _EmbeddedServer | None = None
        self._task: asyncio.Task[None] | None = None
        self.port: int | None = None  # the bound port, once started

    @property
    def url(self) -> str | None:
        """Base URL of the endpoints once started (``host`` as configured)."""
        if self.port is None:
            return None
        host = self.settings.host
        host = f"[{host}]" if ":" in host else host
        return f"{self.settings.scheme}://{host}:{self.port}"

    async def start(self) -> None:
        """Bind and serve until :meth:`stop`; returns once the server accepts connections."""
        if self._task is not None:
            raise RuntimeError("the HTTP server is already running")
        config = uvicorn.Config(
            self.app,
            lifespan="off",
            log_config=None,  # the worker's logging stays as configured
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=1,
            **self.settings.uvicorn_tls(),
        )
        server = self._server = _EmbeddedServer(config)
        sock = self._bind()
        self.port = sock.getsockname()[1]
        self._task = asyncio.create_task(server.serve(sockets=[sock]), name="rollout-http")
        self._task.add_done_callback(_log_failure)
        while not server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        logger.info("GET /health and /metrics on %s", self.url)

    async def stop(self) -> None:
        """Close the port (open connections get ``timeout_graceful_shutdown``)."""
        task, self._task = self._task, None
        if task is None or self._server is None:
            return
        self._server.should_exit = True
        _, pending = await asyncio.wait([task], timeout=5.0)
        for t in pending:
            t.cancel()

    def _bind(self) -> socket.socket:
        host, port = self.settings.host, self.settings.port
        try:
            return _listen(host, port)
        except OSError as exc:
            explicit = "port" in self.settings.model_fields_set
            if exc.errno != errno.EADDRINUSE or explicit or port == 0:
                raise BindError(
                    exc.errno,
                    f"cannot serve /health and /metrics on {host}:{port}: {exc.strerror} "
                    "(set DELTARL_ROLLOUT_PORT or --port to another port, 0: any free one)",
                ) from exc
        sock = _listen(host, 0)
        logger.warning(
            "port %d is taken (another worker on this machine?): /health and /metrics use port "
            "%d instead (DELTARL_ROLLOUT_PORT sets one)",
            port,
            sock.getsockname()[1],
        )
        return sock


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family)


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("the HTTP server stopped: %r", task.exception())
