"""``GET /health`` and ``GET /metrics``."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from deltarl.services.coordinator.deps import CoordinatorDep, ReaderAuth
from deltarl.services.coordinator.schemas import Health

router = APIRouter(tags=["health"])


@router.get("/health", response_model=Health)
async def health(coordinator: CoordinatorDep) -> Health:
    try:
        await coordinator.run(coordinator.store.ping)
    except Exception as exc:  # report, do not raise: health must answer
        return Health(status="degraded", store=coordinator.store.name, detail=str(exc))
    return Health(status="healthy", store=coordinator.store.name)


@router.get(
    "/metrics",
    response_class=Response,
    dependencies=[ReaderAuth],
    responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text"}},
)
async def metrics(request: Request) -> Response:
    coordinator = request.app.state.coordinator
    text = await coordinator.run(generate_latest, request.app.state.metrics.registry)
    return Response(text, media_type=CONTENT_TYPE_LATEST)
