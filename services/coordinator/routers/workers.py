"""``/v1/workers``: register (rejoin), heartbeat, list, get, remove."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Response

from deltarl.services.schemas import HeartbeatAck, WorkerHeartbeat, WorkerInfo, WorkerRegistration
from deltarl.services.schemas.common import ID_PATTERN

from ..deps import CoordinatorDep, ReaderAuth, WorkerAuth
from .common import ERRORS

router = APIRouter(prefix="/v1/workers", tags=["workers"], responses=ERRORS)
WorkerId = Annotated[str, Path(pattern=ID_PATTERN)]


@router.post("", response_model=HeartbeatAck, dependencies=[WorkerAuth])
def register(body: WorkerRegistration, coordinator: CoordinatorDep) -> HeartbeatAck:
    """Register, or re-register after a restart or a loss (a clean rejoin)."""
    return coordinator.register(body)


@router.post("/{worker_id}/heartbeat", response_model=HeartbeatAck, dependencies=[WorkerAuth])
def heartbeat(
    worker_id: WorkerId, body: WorkerHeartbeat, coordinator: CoordinatorDep
) -> HeartbeatAck:
    return coordinator.heartbeat(worker_id, body)


@router.get("", response_model=list[WorkerInfo], dependencies=[ReaderAuth])
def list_workers(coordinator: CoordinatorDep) -> list[WorkerInfo]:
    return coordinator.workers()


@router.get("/{worker_id}", response_model=WorkerInfo, dependencies=[ReaderAuth])
def get_worker(worker_id: WorkerId, coordinator: CoordinatorDep) -> WorkerInfo:
    return coordinator.worker(worker_id)


@router.delete("/{worker_id}", status_code=204, response_class=Response, dependencies=[WorkerAuth])
def remove_worker(worker_id: WorkerId, coordinator: CoordinatorDep) -> Response:
    """Leave the pool (elastic scale-down). The worker's queued groups stay queued."""
    coordinator.remove_worker(worker_id)
    return Response(status_code=204)
