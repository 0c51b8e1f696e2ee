"""``GET /v1/plan?from=&to=&context=``: what a replica fetches to reach a version (cheapest by bytes)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from deltarl.services.coordinator.deps import CoordinatorDep, ReaderAuth
from deltarl.services.coordinator.routers.common import ERRORS
from deltarl.services.coordinator.schemas import CatchUpPlan
from deltarl.services.coordinator.schemas.common import MAX_VERSION

router = APIRouter(prefix="/v1", tags=["plans"], responses=ERRORS)


@router.get("/plan", response_model=CatchUpPlan, dependencies=[ReaderAuth])
async def plan(
    coordinator: CoordinatorDep,
    from_version: Annotated[
        int | None,
        Query(alias="from", ge=0, le=MAX_VERSION, description="Version held; omit if none."),
    ] = None,
    to_version: Annotated[
        int | None,
        Query(alias="to", ge=0, le=MAX_VERSION, description="Target; omit for the latest."),
    ] = None,
    formats: Annotated[
        list[str] | None, Query(alias="format", description="Only objects in these formats.")
    ] = None,
    context: Annotated[
        int | None,
        Query(
            ge=0,
            le=MAX_VERSION,
            description="Base version of the delta the replica applied last to reach `from`; "
            "chained deltas are planned only with it.",
        ),
    ] = None,
) -> CatchUpPlan:
    return await coordinator.run(coordinator.plan, from_version, to_version, formats, context)
