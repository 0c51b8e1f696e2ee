"""The environment server's HTTP routes: OpenEnv's info routes and the stateful HTTP sessions,
over one :class:`EnvService` (the task, the session store, the metrics) that the WebSocket
protocol (:mod:`.ws`) shares."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from deltarl import __version__
from deltarl.env_server.core.http import (
    ERROR_RESPONSES,
    body_doc,
    parse,
    read_body,
    session_header,
)
from deltarl.env_server.core.metrics import EnvMetrics
from deltarl.env_server.core.models import (
    CloseRequest,
    CloseResponse,
    EnvError,
    EnvMetadata,
    ErrorCode,
    HealthResponse,
    ResetRequest,
    SchemaResponse,
    StepRequest,
    StepResult,
    TextAction,
)
from deltarl.env_server.core.sessions import Session, SessionStore
from deltarl.env_server.core.task import Task, TaskSpec
from deltarl.env_server.settings import EnvSettings
from deltarl.services.common.errors import validation_text


@dataclass
class EnvService:
    """What every route works on: the settings, the task, its sessions and the metrics."""

    settings: EnvSettings
    task: Task
    spec: TaskSpec
    store: SessionStore
    metrics: EnvMetrics

    def check_message(self, action: TextAction) -> str:
        """The action's text, refused over ``max_message_chars``."""
        limit = self.settings.max_message_chars
        if len(action.message) > limit:
            raise EnvError(
                ErrorCode.PAYLOAD_TOO_LARGE,
                f"action.message has {len(action.message)} characters; the limit is {limit}",
            )
        return action.message

    def reset_options(self, options: dict[str, Any] | None) -> BaseModel | None:
        """A reset's ``options`` validated by the task's options model (None or empty: the
        server's settings); refused with ``VALIDATION_ERROR`` naming the field, or the task,
        when it takes none."""
        if not options:
            return None
        model = self.task.options
        if model is None:
            raise EnvError(
                ErrorCode.VALIDATION_ERROR,
                f"options: the {self.task.name} task takes no reset options "
                f"(got {', '.join(sorted(options)[:8])})",
            )
        try:
            return model.model_validate(options)
        except ValidationError as err:
            errors = err.errors(include_input=False)
            raise EnvError(
                ErrorCode.VALIDATION_ERROR, "options." + validation_text(errors)
            ) from None

    def finish(self, session: Session, result: StepResult[Any], transport: str) -> None:
        """Count a step; a step that ended the game counts its outcome and stops the session."""
        if result.done:
            outcome = session.env.outcome
            assert outcome is not None
            self.metrics.game_over(outcome)
            session.playing = False
        self.metrics.step[transport].inc()


def add_info_routes(app: FastAPI, service: EnvService) -> None:
    """``GET /health`` (no token), ``/metadata``, ``/schema``, ``/metrics``."""
    task, spec, metrics = service.task, service.spec, service.metrics

    @app.get("/health", response_model=HealthResponse, tags=["info"])
    async def health() -> HealthResponse:
        """Liveness: ``{"status": "healthy"}`` (never needs the token)."""
        return HealthResponse()

    @app.get("/metadata", response_model=EnvMetadata, tags=["info"])
    async def metadata() -> EnvMetadata:
        """OpenEnv ``EnvironmentMetadata``, with the task's system prompt and turn limit."""
        return EnvMetadata(
            name=task.name,
            description=spec.description,
            version=__version__,
            author="deltarl",
            documentation_url="docs/env_server.md",
            system_prompt=spec.system_prompt,
            max_turns=spec.max_turns,
        )

    @app.get("/schema", response_model=SchemaResponse, tags=["info"])
    async def schema() -> SchemaResponse:
        """JSON schemas of the action, the observation and the state."""
        return SchemaResponse(
            action=TextAction.model_json_schema(),
            observation=task.observation.model_json_schema(),
            state=task.state.model_json_schema(),
            options=None if task.options is None else task.options.model_json_schema(),
        )

    @app.get("/metrics", tags=["info"], response_class=Response)
    async def prometheus() -> Response:
        """Prometheus text format."""
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def add_session_routes(app: FastAPI, service: EnvService) -> None:
    """``POST /reset``, ``POST /step``, ``GET /state``, ``POST /close``: sessions over HTTP."""
    store, metrics, task = service.store, service.metrics, service.task
    result_model = StepResult[task.observation]  # type: ignore[name-defined]

    @app.post(
        "/reset",
        response_model=result_model,
        responses=ERROR_RESPONSES,
        tags=["env"],
        openapi_extra=body_doc(ResetRequest),
    )
    async def reset(request: Request) -> Response:
        """Open a session (or reset ``session_id``) and return the first observation."""
        req = parse(ResetRequest, await read_body(request), default=True)
        session = store.get(req.session_id) if req.session_id else store.open("http")
        with session.claim():
            try:
                result = session.env.reset(
                    seed=req.seed,
                    episode_id=req.episode_id,
                    options=service.reset_options(req.options),
                    policy_version=req.policy_version,
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
        response_model=result_model,
        responses=ERROR_RESPONSES,
        tags=["env"],
        openapi_extra=body_doc(StepRequest),
    )
    async def step(request: Request) -> Response:
        """Play ``action.message`` in the session; replays the cached answer for a repeated
        ``request_id``."""
        started = time.perf_counter()
        req = parse(StepRequest, await read_body(request))
        session = store.get(req.session_id or session_header(request))
        message = service.check_message(req.action)
        with session.claim():
            if req.request_id is not None and req.request_id == session.last_request_id:
                assert session.last_response is not None
                body = session.last_response
            else:
                result = session.env.step(message)
                result.session_id = session.id
                body = result.model_dump_json()
                service.finish(session, result, "http")
                session.last_request_id = req.request_id
                session.last_response = body if req.request_id is not None else None
        store.touch(session)
        metrics.step_seconds.observe(time.perf_counter() - started)
        return Response(body, media_type="application/json")

    @app.get("/state", response_model=task.state, responses=ERROR_RESPONSES, tags=["env"])
    async def state(
        request: Request, session_id: Annotated[str | None, Query(max_length=64)] = None
    ) -> Response:
        """State of the session; without a session id, the empty state (as OpenEnv's stateless
        server answers)."""
        sid = session_id or session_header(request)
        if not sid:
            fresh = service.spec.empty_state()
            return Response(fresh.model_dump_json(), media_type="application/json")
        session = store.get(sid)
        store.touch(session)
        return Response(session.env.state().model_dump_json(), media_type="application/json")

    @app.post(
        "/close",
        response_model=CloseResponse,
        responses=ERROR_RESPONSES,
        tags=["env"],
        openapi_extra=body_doc(CloseRequest),
    )
    async def close(request: Request) -> CloseResponse:
        """Free the session now. Idempotent: closing an unknown session answers ``closed: false``."""
        req = parse(CloseRequest, await read_body(request), default=True)
        sid = req.session_id or session_header(request)
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
