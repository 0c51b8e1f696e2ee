"""``/v1/dead-letters``: groups set aside (refused by the trainer, or leased twice without an
ack), listed with why, and put back in the queue by an operator."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Response

from deltarl.services.coordinator.deps import CoordinatorDep, ReaderAuth, TrainerAuth
from deltarl.services.coordinator.routers.common import ERRORS
from deltarl.services.coordinator.schemas import DeadLetterList
from deltarl.services.coordinator.schemas.common import INT64_MAX

router = APIRouter(prefix="/v1/dead-letters", tags=["dead letters"], responses=ERRORS)


@router.get("", response_model=DeadLetterList, dependencies=[ReaderAuth])
async def list_dead_letters(
    coordinator: CoordinatorDep,
    limit: Annotated[int, Query(ge=1, le=1000, description="Most dead letters listed.")] = 100,
) -> DeadLetterList:
    """The newest dead letters (their payloads stay in the store)."""
    return await coordinator.run(coordinator.dead_letters, limit)


@router.post(
    "/{submission_id}/requeue",
    status_code=204,
    response_class=Response,
    dependencies=[TrainerAuth],
)
async def requeue(
    submission_id: Annotated[int, Path(ge=0, le=INT64_MAX)], coordinator: CoordinatorDep
) -> Response:
    """Put a dead letter back in the queue, ahead of the groups submitted after it (404
    ``unknown_dead_letter``). It may be refused again."""
    await coordinator.run(coordinator.requeue_dead_letter, submission_id)
    return Response(status_code=204)
