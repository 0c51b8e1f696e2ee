"""``GET /v1/status``: the run at a glance."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Response

from deltarl.services.coordinator.deps import CoordinatorDep, ReaderAuth
from deltarl.services.coordinator.routers.common import ERRORS
from deltarl.services.coordinator.schemas import StatusSummary

router = APIRouter(prefix="/v1", tags=["status"], responses=ERRORS)


@router.get("/status", response_model=StatusSummary, dependencies=[ReaderAuth])
async def status(
    coordinator: CoordinatorDep,
    workers: Annotated[int | None, Query(ge=0, le=100_000, description="Workers listed.")] = None,
) -> Response:
    """Served from a short cache (``Pacing.status_cache_s``, half a second), already serialized."""
    body = await coordinator.run(coordinator.status_json, workers)
    return Response(body, media_type="application/json")
